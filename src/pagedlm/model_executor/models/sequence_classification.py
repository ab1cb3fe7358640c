"""Llama-family decoders with a sequence-classification head instead of an LM head
(``Qwen2ForSequenceClassification``, ... as transformers saves them): the decoder's
tensors under ``model.``, the head's ``score.weight`` [num_labels, hidden] without bias.

The pooling runner pools each prompt's last final-normed hidden state (transformers reads
the last token too, for a prompt without padding) and calls ``classifier_logits`` on it.
Each class is named as the ``architectures`` entry it serves.
"""

from __future__ import annotations

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
