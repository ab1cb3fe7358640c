"""``LlamaModel``'s stack with layers an architecture builds itself (Granite, SmolLM3).

The stack is Llama's — token embedding, pre-norm layers that carry the residual stream
beside the hidden states, final RMSNorm, pipeline stages — but ``build_layer(i)`` makes
layer ``i``, so an architecture whose blocks compute something else (multipliers, layers
without rotary) uses its own module classes there, and a layer that is Llama's math stays
a plain ``LlamaDecoderLayer`` the platforms' kernels recognize.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import IntermediateTensors, this_stage_layers
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.models.llama import LlamaModel
from pagedlm.model_executor.models.stages import on_first_stage, on_last_stage, stage_layers


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
        self.embed_tokens = on_first_stage(
            lambda: VocabParallelEmbedding(arch.vocab_size, arch.hidden_size),
            also_last=arch.tie_word_embeddings,  # the LM head shares its table
        )
        self.embedding_multiplier = embedding_multiplier
        self.layers = stage_layers(arch.num_hidden_layers, build_layer)
        self.start_layer, self.end_layer = this_stage_layers(arch.num_hidden_layers)
        self.is_last_stage = get_pipeline_state().is_last
        self.norm = on_last_stage(lambda: RMSNorm(arch.hidden_size, arch.rms_norm_eps))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        residual: torch.Tensor | None
        if intermediate is None:
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
            if self.embedding_multiplier != 1.0:
                x = x * self.embedding_multiplier
        else:
            x, residual = intermediate["hidden_states"], intermediate["residual"]
        for layer in itertools.islice(self.layers, self.start_layer, self.end_layer):
            x, residual = layer(positions, x, residual, ctx)
        if not self.is_last_stage:
            return {"hidden_states": x, "residual": residual}
        x, _ = self.norm(x, residual)
        return x
