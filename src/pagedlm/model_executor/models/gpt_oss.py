"""gpt-oss (OpenAI's gpt-oss-20b / -120b): a pre-norm decoder whose attention has a learned
sink per head and whose MLP is a mixture of experts.

- Attention: q/k/v/o with biases, grouped kv heads, YaRN rope (``truncate`` false in the
  released configs), layers alternating between a sliding window (128 tokens in the
  released models; ``layer_types``) and full attention, and ``sinks`` [heads]: a logit
  per head that joins every query's softmax denominator with no value, so a head may
  attend to nothing much. The ``Attention`` layer holds the sinks and hands them to the
  backend, which refuses the layer unless it ``supports_sinks``.
- MLP: ``GptOssMoE`` (``gpt_oss_moe.py``): a router with a bias, softmax over the top-k
  logits, experts with biases and a clamped SwiGLU.
- RMSNorm before attention and MLP and at the end, the residual stream carried beside
  the hidden states: the Llama stack (``LlamaStack``) with these blocks in it.

Checkpoints: transformers' names, q/k/v merged into ``qkv_proj`` as for Llama, the sinks
under ``self_attn.attn.sinks``. The released checkpoints store the experts in MXFP4
(``*_blocks`` / ``*_scales``); those are refused with a pointer to the bf16 conversions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm.model_executor.layers.rotary_scaled import get_rope_for_arch
from pagedlm.model_executor.models.gpt_oss_moe import EXPERT_TENSORS, GptOssMoE
from pagedlm.model_executor.models.llama import (
    BlockOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
)
from pagedlm.model_executor.models.llama_stack import LlamaStack
from pagedlm.model_executor.models.sliding_window import layer_sliding_windows

BF16_CHECKPOINTS = "unsloth/gpt-oss-20b-BF16 or unsloth/gpt-oss-120b-BF16"
"""Conversions of the released models with every weight in bf16, which pagedlm loads."""


def refuse_mxfp4(arch: ArchConfig) -> None:
    """The released checkpoints' experts are MXFP4 blocks, which pagedlm does not read."""
    quantization = arch.raw.get("quantization_config") or {}
    if str(quantization.get("quant_method", "")).lower() == "mxfp4":
        raise ValueError(
            "this gpt-oss checkpoint stores its experts in MXFP4, which pagedlm cannot load; "
            f"use a bf16 conversion ({BF16_CHECKPOINTS}) or convert it with transformers "
            "(from_pretrained with Mxfp4Config(dequantize=True), then save_pretrained)."
        )


class GptOssAttention(LlamaAttention):
    """Llama's attention with biased q/k/v/o and a sink per head: x [T, hidden] ->
    [T, hidden]."""

    def __init__(
        self,
        arch: ArchConfig,
        layer_idx: int,
        rotary_emb: RotaryEmbedding,
        sliding_window: int | None,
    ) -> None:
        options = BlockOptions(qkv_bias=arch.attention_bias, o_proj_bias=arch.attention_bias)
        super().__init__(arch, layer_idx, rotary_emb, options, sliding_window)
        self.attn = Attention(
            layer_idx,
            num_heads=self.qkv_proj.num_heads,
            num_kv_heads=self.qkv_proj.num_kv_heads,
            head_dim=arch.head_dim,
            scale=arch.head_dim**-0.5,
            sliding_window=sliding_window,
            sinks=True,
        )


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss; pipeline and tensor parallel (the experts sliced or, with expert
    parallelism, spread over the ranks)."""

    # q/k/v merge as Llama's; there is no dense gate/up projection to merge.
    stacked_params: ClassVar[tuple[tuple[str, str, str | int], ...]] = (
        LlamaForCausalLM.stacked_params[:3]
    )

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        refuse_mxfp4(arch)
        self.arch = arch
        rotary_emb = get_rope_for_arch(arch, max_model_len)
        windows = layer_sliding_windows(arch)

        def build_layer(i: int) -> LlamaDecoderLayer:
            attention = GptOssAttention(arch, i, rotary_emb, windows[i])
            return LlamaDecoderLayer(arch, attention, GptOssMoE(arch))

        self.model = LlamaStack(arch, build_layer)
        self.add_lm_head(self.model.embed_tokens, arch.tie_word_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        modules = dict(self.named_modules())

        def others(
            weights: Iterable[tuple[str, torch.Tensor]],
        ) -> Iterator[tuple[str, torch.Tensor]]:
            """The experts loaded here; the rest renamed for Llama's loader."""
            for name, tensor in weights:
                if name.endswith(("_blocks", "_scales")):
                    raise ValueError(
                        f"checkpoint tensor {name!r} is MXFP4-quantized, which pagedlm "
                        f"cannot load; use a bf16 conversion ({BF16_CHECKPOINTS})."
                    )
                if self.is_other_stage(name):
                    continue
                prefix, _, leaf = name.rpartition(".experts.")
                if prefix and leaf in EXPERT_TENSORS:
                    moe = modules.get(prefix)
                    if not isinstance(moe, GptOssMoE):
                        raise ValueError(
                            f"checkpoint tensor {name!r} has no MoE layer in "
                            f"{type(self).__name__}; the file does not match its config.json."
                        )
                    loaded.add(f"{prefix}.{moe.load_expert_tensor(leaf, tensor)}")
                    continue
                if name.endswith(".self_attn.sinks"):
                    name = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
                yield name, tensor

        return loaded | super().load_weights(others(weights))
