"""GPT-2: learned absolute positions, pre-LayerNorm blocks, GELU MLP, tied LM head.

Checkpoints store every projection as a ``Conv1D`` whose weight is ``[in, out]`` (the
transpose of ``nn.Linear``'s), with q, k and v fused in ``attn.c_attn``. ``load_weights``
transposes them into our ``[out, in]`` linears and splits ``c_attn`` into q/k/v shards, so
tensor parallelism slices heads exactly as for Llama. Parameter names keep HF's
(``transformer.h.{i}.attn.c_attn`` ...); files saved without the ``transformer.`` prefix
(the original ``gpt2`` repository) load too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import IntermediateTensors, this_stage_layers
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import Attention
from pagedlm.model_executor.layers.gelu import get_gelu
from pagedlm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.loader.weight_utils import get_weight_loader
from pagedlm.model_executor.models.causal_lm import CausalLM
from pagedlm.model_executor.models.stages import on_first_stage, on_last_stage, stage_layers

# Conv1D weights ([in, out] in the file) that must be transposed on load.
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _layer_norm_eps(arch: ArchConfig) -> float:
    return float(arch.raw.get("layer_norm_epsilon", 1e-5))


class GPT2Attention(nn.Module):
    """x [T, hidden] -> c_proj(attention(q, k, v)) [T, hidden]; no rotary, biases on."""

    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, heads = arch.hidden_size, arch.num_attention_heads
        head_dim = arch.head_dim
        self.c_attn = QKVParallelLinear(hidden, head_dim, heads, heads, bias=True)
        self.c_proj = RowParallelLinear(hidden, hidden, bias=True)
        scale = head_dim**-0.5 if arch.raw.get("scale_attn_weights", True) else 1.0
        if arch.raw.get("scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.attn = Attention(
            layer_idx,
            num_heads=self.c_attn.num_heads,
            num_kv_heads=self.c_attn.num_kv_heads,
            head_dim=head_dim,
            scale=scale,
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        q, k, v = self.c_attn.split(self.c_attn(x))
        return self.c_proj(self.attn(q, k, v, ctx))


class GPT2MLP(nn.Module):
    """x [T, hidden] -> c_proj(gelu(c_fc(x))) [T, hidden]."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.c_fc = ColumnParallelLinear(arch.hidden_size, arch.intermediate_size, bias=True)
        self.act = get_gelu(arch.hidden_act or "gelu_new")
        self.c_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """x [T, hidden] -> h + mlp(ln_2(h)), h = x + attn(ln_1(x))."""

    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        eps = _layer_norm_eps(arch)
        self.ln_1 = nn.LayerNorm(arch.hidden_size, eps=eps)
        self.attn = GPT2Attention(arch, layer_idx)
        self.ln_2 = nn.LayerNorm(arch.hidden_size, eps=eps)
        self.mlp = GPT2MLP(arch)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ctx)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """input_ids, positions [T] -> ln_f(blocks(wte(ids) + wpe(positions))) [T, hidden]."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        tied = bool(arch.raw.get("tie_word_embeddings", True))
        self.wte = on_first_stage(
            lambda: VocabParallelEmbedding(arch.vocab_size, arch.hidden_size), also_last=tied
        )
        self.wpe = on_first_stage(
            lambda: VocabParallelEmbedding(arch.max_position_embeddings, arch.hidden_size)
        )
        self.h = stage_layers(arch.num_hidden_layers, lambda i: GPT2Block(arch, i))
        self.start_layer, self.end_layer = this_stage_layers(arch.num_hidden_layers)
        self.is_last_stage = get_pipeline_state().is_last
        self.ln_f = on_last_stage(lambda: nn.LayerNorm(arch.hidden_size, eps=_layer_norm_eps(arch)))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if intermediate is None:
            x = self.wte(input_ids) + self.wpe(positions)
        else:
            x = intermediate["hidden_states"]
        for block in itertools.islice(self.h, self.start_layer, self.end_layer):
            x = block(x, ctx)
        if not self.is_last_stage:
            return {"hidden_states": x}
        return self.ln_f(x)


class GPT2LMHeadModel(CausalLM):
    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.transformer = GPT2Model(arch)
        self.add_lm_head(self.transformer.wte, bool(arch.raw.get("tie_word_embeddings", True)))

    @property
    def decoder(self) -> nn.Module:
        return self.transformer

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith((".attn.bias", ".attn.masked_bias")):
                continue  # causal-mask buffers some old checkpoints saved
            if name == "lm_head.weight" and self.tied:
                continue
            if not name.startswith(("transformer.", "lm_head.")):
                name = f"transformer.{name}"
            if self.is_other_stage(name):
                continue
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in GPT2LMHeadModel; the "
                    "file does not match a GPT-2 architecture."
                )
            param = params[name]
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            if ".attn.c_attn." in name:
                for shard_id, part in zip("qkv", tensor.chunk(3, dim=0), strict=True):
                    param.weight_loader(param, part, shard_id)
            else:
                get_weight_loader(param)(param, tensor)
            loaded.add(name)
        return loaded
