"""Llama-family decoders with a sequence-classification head instead of an LM head
(``Qwen2ForSequenceClassification``, ... as transformers saves them): the decoder's
tensors under ``model.``, the head's ``score.weight`` [num_labels, hidden] without bias.

A causal LM becomes one through vLLM's ``hf_overrides`` (``architectures`` and
``classifier_from_token``, as Qwen3-Reranker is served): ``score`` is read from the LM
head's rows of those tokens, and with two tokens it is the second's row minus the
first's, so the sigmoid of the one logit is the softmax probability of the second token.

The pooling runner pools each prompt's last final-normed hidden state (transformers reads
the last token too, for a prompt without padding) and calls ``classifier_logits`` on it.
Each class is named as the ``architectures`` entry it serves.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagedlm.config import ArchConfig
from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from pagedlm.pooling.model_config import classifier_config


class _Classifier:
    """Mixed into a ``LlamaForCausalLM`` subclass: ``score`` in place of the LM head."""

    arch: ArchConfig
    tied: bool
    score: nn.Linear

    def add_lm_head(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        self.tied = False  # there is no LM head; a stray lm_head tensor fails to load
        num_labels = classifier_config(self.arch).num_labels
        assert num_labels is not None
        # Replicated on every rank: [num_labels, hidden] is a few kilobytes.
        self.score = nn.Linear(self.arch.hidden_size, num_labels, bias=False)

    def classifier_logits(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled hidden states -> [N, num_labels] logits."""
        return self.score(pooled)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """A causal LM's tensors with ``classifier_from_token_ids`` (``hf_overrides``): the
        head's rows of those tokens become ``score`` (two: the second minus the first)."""
        ids = self.arch.raw.get("classifier_from_token_ids")
        if not ids:
            return super().load_weights(weights)  # type: ignore[misc]
        head: dict[str, torch.Tensor] = {}
        sources = ("lm_head.weight", "model.embed_tokens.weight")  # the second only if tied

        def without_head() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name in sources:
                    head[name] = tensor
                if name != "lm_head.weight":
                    yield name, tensor

        loaded = super().load_weights(without_head())  # type: ignore[misc]
        table = head.get(sources[0])
        if table is None and self.arch.tie_word_embeddings:
            table = head.get(sources[1])
        if table is None:
            raise ValueError(
                "classifier_from_token reads the LM head, and the checkpoint has none "
                "(no lm_head.weight, no tied embeddings)."
            )
        rows = table[ids].float()
        weight = rows[1:] - rows[:1] if len(ids) == 2 else rows
        with torch.no_grad():
            self.score.weight.copy_(weight)
        return loaded | {"score.weight"}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError(
            f"{type(self).__name__} has no LM head; it only classifies (runner='pooling')."
        )


class LlamaForSequenceClassification(_Classifier, LlamaForCausalLM):
    """``LlamaForSequenceClassification`` checkpoints."""


class MistralForSequenceClassification(_Classifier, MistralForCausalLM):
    """``MistralForSequenceClassification`` checkpoints."""


class Qwen2ForSequenceClassification(_Classifier, Qwen2ForCausalLM):
    """``Qwen2ForSequenceClassification`` checkpoints."""


class Qwen3ForSequenceClassification(_Classifier, Qwen3ForCausalLM):
    """``Qwen3ForSequenceClassification`` checkpoints."""
