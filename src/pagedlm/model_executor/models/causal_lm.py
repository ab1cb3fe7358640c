"""What every model class gives the model runner: hidden states, logits and weight loading.

A model is a decoder stack, named as in its checkpoint (``model`` for Llama and Gemma,
``transformer`` for GPT-2), plus an LM head that may share the token embedding's table.
``CausalLM`` holds what is the same for all of them; the stack and the checkpoint layout
(``load_weights``) are each architecture's own.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.distributed.parallel_state import get_pipeline_state
from pagedlm.distributed.pipeline import IntermediateTensors
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedlm.model_executor.models.stages import PPMissingLayer, missing_prefixes


class CausalLM(nn.Module, ABC):
    """Base of the model classes: ``forward`` runs the stack, ``compute_logits`` the head.

    A subclass builds its stack, then calls ``add_lm_head``. Invariant: when ``tied``, the
    head's weight *is* the embedding's, and ``load_weights`` skips ``lm_head.weight``.

    Under pipeline parallelism a model holds one stage (``stages.py``): the stack takes
    the previous stage's ``IntermediateTensors`` (named ``intermediate_names``) instead of
    token ids, and every stage but the last returns its own instead of hidden states;
    only the last stage has an LM head. ``load_weights`` skips tensors of other stages
    (``is_other_stage``).
    """

    arch: ArchConfig
    tied: bool
    lm_head: ParallelLMHead
    intermediate_names: ClassVar[tuple[str, ...]] = ("hidden_states",)
    """What one stage of this model hands the next, each ``[num_tokens, hidden_size]``."""
    supports_prompt_embeds: ClassVar[bool] = False
    """``forward`` takes ``inputs_embeds`` (prompts given as embeddings): its decoder starts
    from them and applies what the model does after its embedding layer (a multiplier)."""

    @property
    @abstractmethod
    def decoder(self) -> nn.Module:
        """The stack: (input_ids, positions [num_tokens], ctx) -> [num_tokens, hidden_size]."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the parameter names filled."""

    def add_lm_head(
        self, embedding: VocabParallelEmbedding, tied: bool, bias: bool = False
    ) -> None:
        """Create ``lm_head`` [vocab, hidden], sharing ``embedding``'s table when ``tied``;
        ``bias``: with ``lm_head.bias`` [vocab] (Phi), loaded even when tied."""
        self.tied = tied
        if not get_pipeline_state().is_last:
            self.lm_head = PPMissingLayer()  # type: ignore[assignment]
            return
        self.lm_head = ParallelLMHead(self.arch.vocab_size, self.arch.hidden_size, bias=bias)
        if tied:
            self.lm_head.tie_to(embedding)

    def is_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to another pipeline stage."""
        prefixes = self.__dict__.get("_other_stage_prefixes")
        if prefixes is None:
            prefixes = self.__dict__["_other_stage_prefixes"] = missing_prefixes(self)
        return bool(prefixes) and name.startswith(prefixes)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        intermediate: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [num_tokens] -> hidden states [num_tokens, hidden_size]
        (a pipeline stage but the last: its ``IntermediateTensors``; a stage but the
        first reads ``intermediate`` instead of ``input_ids``). ``inputs_embeds``
        [num_tokens, hidden_size] (models that ``supports_prompt_embeds``): the rows
        ``embed_input_ids`` would give, read instead of ``input_ids``."""
        if inputs_embeds is None:
            return self.decoder(input_ids, positions, ctx, intermediate)
        return self.decoder(input_ids, positions, ctx, intermediate, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]: what the checkpoint's input embedding layer gives
        (transformers' ``get_input_embeddings()``), before any multiplier the decoder
        applies after it."""
        return self.decoder.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden_size] (only the sampled rows) -> [N, vocab] logits in
        the model's dtype."""
        return self.lm_head(hidden_states)
