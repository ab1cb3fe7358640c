"""EAGLE draft heads for Llama-family targets, in the EAGLE authors' checkpoint layouts.

Both heads draft from the target's hidden states and share the target's token embedding
(unless the checkpoint has its own ``embed_tokens.weight``); their KV lives in the paged
cache under the target's block ids. A head row at position ``p`` takes the token at
``p + 1`` and a hidden state for position ``p`` and outputs one for ``p + 1``: the target's
hidden states for positions the target computed, the head's own output after that.

- EAGLE-1 (``yuhuili/EAGLE-LLaMA3.1-Instruct-8B``; config ``LlamaForCausalLM``): ``fc``
  [hidden, 2 hidden] (with ``fc.bias`` when config's ``bias`` is true, the authors'
  default) over ``cat(embed(token), target's final normed hidden)``, then Llama decoder
  layers (``layers.{i}.*``) of which the first has no ``input_layernorm``; the output
  (residual added, no final norm) goes through the target's LM head.
- EAGLE-3 (``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``; config ``LlamaForCausalLMEagle3``):
  ``fc`` [hidden, 3 target_hidden] fuses the target's hidden states entering three of its
  layers (``eagle_aux_hidden_state_layer_ids``, default ``(2, L // 2, L - 3)``); one
  ``midlayer`` whose attention reads ``cat(input_layernorm(embed), hidden_norm(hidden))``
  ([2 hidden] into q/k/v); ``norm``; its own ``lm_head`` over ``draft_vocab_size`` tokens,
  mapped to target ids by ``d2t`` (target id = draft id + ``d2t[draft id]``; ``t2d`` is not
  needed). Its next step's hidden input is its output before ``norm``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear
from pagedlm.model_executor.layers.rotary_scaled import get_rope_for_arch
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.loader.weight_utils import get_weight_loader
from pagedlm.model_executor.models.llama import (
    BlockOptions,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)


class _EagleHead(nn.Module):
    """What both heads share: optional own embedding, weight loading by HF names."""

    arch: ArchConfig
    renames: tuple[tuple[str, str], ...] = ()
    skipped: tuple[str, ...] = ()

    def maybe_own_embedding(self, has_embedding: bool) -> None:
        self.embed_tokens = (
            VocabParallelEmbedding(self.arch.vocab_size, self.arch.hidden_size)
            if has_embedding
            else None
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name
            for old, new in self.renames:
                name = name.replace(old, new)
            if name in self.skipped or "rotary_emb.inv_freq" in name:
                continue
            if name in buffers:
                buffers[name].copy_(tensor)
                loaded.add(name)
                continue
            for merged, part, shard_id in LlamaForCausalLM.stacked_params:
                if f".{part}." in name:
                    name = name.replace(f".{part}.", f".{merged}.")
                    self._param(params, name, hf_name).weight_loader(params[name], tensor, shard_id)
                    break
            else:
                param = self._param(params, name, hf_name)
                get_weight_loader(param)(param, tensor)
            loaded.add(name)
        return loaded

    def _param(self, params: dict[str, nn.Parameter], name: str, hf_name: str) -> nn.Parameter:
        if name not in params:
            raise ValueError(
                f"EAGLE checkpoint tensor {hf_name!r} has no place in {type(self).__name__}; "
                "is it an EAGLE-1 head loaded as eagle3 (or the reverse)? Check the method."
            )
        return params[name]


class EagleLlamaHead(_EagleHead):
    """EAGLE-1: forward(embeds [T, H], hidden [T, H], positions [T], ctx) -> [T, H]."""

    def __init__(self, arch: ArchConfig, has_embedding: bool, fc_bias: bool, max_model_len: int):
        super().__init__()
        self.arch = arch
        self.maybe_own_embedding(has_embedding)
        hidden = arch.hidden_size
        self.fc = ColumnParallelLinear(2 * hidden, hidden, bias=fc_bias, gather_output=True)
        rotary = get_rope_for_arch(arch, max_model_len)
        options = BlockOptions()
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, LlamaAttention(arch, i, rotary, options), LlamaMLP(arch, False))
            for i in range(arch.num_hidden_layers)
        )
        # The authors' first layer normalizes nothing on its way in.
        self.layers[0].input_layernorm = nn.Identity()

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, ctx)
        return x + residual


class _Eagle3Layer(LlamaDecoderLayer):
    """The EAGLE-3 midlayer: attention over ``cat(normed embeds, normed hidden)``."""

    def __init__(self, arch: ArchConfig, max_model_len: int) -> None:
        rotary = get_rope_for_arch(arch, max_model_len)
        attention = LlamaAttention(arch, 0, rotary, BlockOptions())
        attention.qkv_proj = QKVParallelLinear(
            2 * arch.hidden_size,
            arch.head_dim,
            arch.num_attention_heads,
            arch.num_key_value_heads,
            bias=False,
        )
        super().__init__(arch, attention, LlamaMLP(arch, False))
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(  # type: ignore[override]
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, ctx)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x) + residual


class Eagle3LlamaHead(_EagleHead):
    """EAGLE-3: ``combine(aux [T, 3 target_hidden]) -> [T, H]``; forward(embeds, hidden,
    positions, ctx) -> its output before ``norm`` [T, H]; ``draft_token_ids(output)`` -> the
    greedy draft in target ids."""

    renames = (("midlayer.", "layers.0."), ("d2t", "draft_id_to_target_id"))
    skipped = ("t2d",)

    def __init__(self, arch: ArchConfig, has_embedding: bool, max_model_len: int) -> None:
        super().__init__()
        self.arch = arch
        self.maybe_own_embedding(has_embedding)
        hidden = arch.hidden_size
        target_hidden = arch.raw.get("target_hidden_size", hidden)
        self.draft_vocab_size = int(arch.raw.get("draft_vocab_size", arch.vocab_size))
        self.fc = ColumnParallelLinear(3 * target_hidden, hidden, bias=False, gather_output=True)
        self.layers = nn.ModuleList([_Eagle3Layer(arch, max_model_len)])
        self.norm = RMSNorm(hidden, arch.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, hidden)
        self.register_buffer(
            "draft_id_to_target_id", torch.zeros(self.draft_vocab_size, dtype=torch.int64)
        )

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(aux_hidden)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        return self.layers[0](positions, embeds, hidden, ctx)

    def draft_token_ids(self, output: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(self.norm(output)).argmax(dim=-1)
        return draft + self.draft_id_to_target_id[draft]
