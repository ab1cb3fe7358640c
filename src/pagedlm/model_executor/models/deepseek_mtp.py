"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft head (vLLM's ``"mtp"``
speculative method, also spelled ``"deepseek_mtp"``).

A V3 / R1 checkpoint holds ``num_nextn_predict_layers`` such layers after the decoder's,
under ``model.layers.{num_hidden_layers + i}``. Each is a whole decoder layer (MLA and the
layer's MoE, ``mtp_block`` here, stored without that prefix) plus:

- ``enorm`` and ``hnorm``: RMSNorms of the next token's embedding and of the hidden state;
- ``eh_proj`` [hidden, 2 hidden]: ``cat(enorm(embedding), hnorm(hidden))`` into the block;
- ``shared_head.norm``: the RMSNorm before the LM head.

The embedding and the LM head are the target's: the V3 report says the MTP modules share
them, and the checkpoint's copies under the layer (``embed_tokens``, ``shared_head.head``)
are not read. Only the first MTP layer is used, for every draft: V3 and R1 have one.
(vLLM cycles drafts through several, draft ``j`` on layer ``j mod n``; the engine warns
where a checkpoint has more than one.)

A head row at position ``p`` takes the token at ``p + 1`` and a hidden state for position
``p``: the target's final normed one where the target computed ``p``, the head's own
output after that (``block output + residual``, before ``shared_head.norm``). The token
embedding at position 0 is zeroed, as in vLLM. Its KV lives in the proposer's own paged
cache (one layer, index 0), latent where the target's is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.models.deepseek_moe import DeepseekMoE, is_moe_layer
from pagedlm.model_executor.models.deepseek_v2 import (
    DeepseekDecoderLayer,
    DeepseekV2ForCausalLM,
    MultiHeadLatentAttention,
    ReplicatedLinear,
    check_cache_head_size,
    latent_rotary,
)
from pagedlm.model_executor.models.llama import LlamaMLP

SHARED_WITH_TARGET = ("embed_tokens.", "shared_head.head.")
"""The layer's tensors that are the target's own (not read)."""


def mtp_layer_count(arch: ArchConfig) -> int:
    return int(arch.raw.get("num_nextn_predict_layers") or 0)


class _EhProj(ReplicatedLinear):
    """Never quantized at load (vLLM builds it as a plain linear layer)."""

    quantized_at_load: ClassVar[bool] = False


class _SharedHead(nn.Module):
    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class DeepSeekMTPLayer(DeepseekDecoderLayer):
    """The decoder layer (its attention at cache index 0) and the MTP parts beside it."""

    def __init__(self, arch: ArchConfig, index: int) -> None:
        attention = MultiHeadLatentAttention(arch, 0, latent_rotary(arch))
        if is_moe_layer(arch, index):
            mlp: nn.Module = DeepseekMoE(arch)
        else:
            mlp = LlamaMLP(arch, bias=bool(arch.raw.get("mlp_bias", False)))
        super().__init__(arch, attention, mlp)
        hidden = arch.hidden_size
        self.enorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, arch.rms_norm_eps)
        self.eh_proj = _EhProj(2 * hidden, hidden, bias=False)
        self.shared_head = _SharedHead(arch)


class _Layers(nn.Module):
    def __init__(self, arch: ArchConfig, index: int) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({str(index): DeepSeekMTPLayer(arch, index)})


class DeepSeekMTP(DeepseekV2ForCausalLM):
    """The first MTP layer of a DeepSeek-V2/V3-family checkpoint (see the module
    docstring); parameters named as the checkpoint names them (``model.layers.{L}.*``).

    ``forward(embeds [T, hidden], hidden [T, hidden], positions [T], ctx)`` -> the next
    hidden state [T, hidden]; ``final_norm(h)`` goes into the target's LM head."""

    def __init__(self, arch: ArchConfig, max_model_len: int | None = None) -> None:
        nn.Module.__init__(self)
        self.arch = arch
        check_cache_head_size(arch)
        if mtp_layer_count(arch) < 1:
            raise ValueError(
                f"{arch.architecture} checkpoint has no multi-token-prediction layer "
                "(num_nextn_predict_layers is 0 or missing in config.json)."
            )
        self.index = arch.num_hidden_layers
        self.model = _Layers(arch, self.index)
        self.tied = False  # the LM head is the target's; nothing here to tie

    @property
    def layer(self) -> DeepSeekMTPLayer:
        return self.model.layers[str(self.index)]  # type: ignore[return-value]

    @staticmethod
    def checkpoint_selector(arch: ArchConfig) -> Callable[[str], bool]:
        """The checkpoint tensors this head reads (the others are never read)."""
        prefix = f"model.layers.{arch.num_hidden_layers}."
        shared = tuple(prefix + name for name in SHARED_WITH_TARGET)
        return lambda name: name.startswith(prefix) and not name.startswith(shared)

    def skips_layer(self, index: int) -> bool:
        return index != self.index

    def forward(  # type: ignore[override]
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        layer = self.layer
        embeds = embeds * (positions != 0).unsqueeze(-1).to(embeds.dtype)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        x, residual = layer(positions, x, None, ctx)
        return x + residual

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """``shared_head.norm``: what the target's LM head reads."""
        return self.layer.shared_head.norm(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError("an MTP head has no LM head of its own; use the target's")
