"""``LlamaModel``'s stack with layers an architecture builds itself (Granite, SmolLM3).

The stack is Llama's — token embedding, pre-norm layers that carry the residual stream
beside the hidden states, final RMSNorm, pipeline stages — but ``build_layer(i)`` makes
layer ``i``, so an architecture whose blocks compute something else (multipliers, layers
without rotary) uses its own module classes there, and a layer that is Llama's math stays
a plain ``LlamaDecoderLayer`` the platforms' kernels recognize.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.models.llama import LlamaModel


class LlamaStack(LlamaModel):
    """input_ids, positions [T] -> final-normed hidden states [T, hidden].

    Each layer is ``(positions, x, residual | None, ctx) -> (x, residual)`` like
    ``LlamaDecoderLayer``. ``embedding_multiplier`` scales the token embeddings (Granite's;
    1.0: unscaled), ``inputs_embeds`` too.
    """

    def __init__(
        self,
        arch: ArchConfig,
        build_layer: Callable[[int], nn.Module],
        embedding_multiplier: float = 1.0,
    ) -> None:
        nn.Module.__init__(self)
        self.embedding_multiplier = embedding_multiplier
        self._build_stack(arch, build_layer)
