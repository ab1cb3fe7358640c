"""Llama-family decoders whose head reads every token: token classifiers
(``LlamaForTokenClassification``, ... as transformers saves them: the decoder's tensors
under ``model.``, the head ``score`` [num_labels, hidden] with a bias unless config.json
says ``token_classification_bias: false``) and Qwen's reward models
(``Qwen2ForRewardModel``, ``Qwen2ForProcessRewardModel``: ``score`` is Linear(hidden,
hidden) -> ReLU -> Linear(hidden, num_labels), both with biases; a saved LM head is
ignored, as vLLM does).

The pooling runner pools them token-wise: ``classifier_logits`` on each prompt token's
final-normed hidden state (transformers' dropout is off at inference). Each class is named
as the ``architectures`` entry it serves.
"""

from __future__ import annotations

from collections.abc import Iterable

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
from pagedlm.pooling.model_config import token_classifier_config


class _TokenClassifier:
    """Mixed into a ``LlamaForCausalLM`` subclass: ``score`` in place of the LM head."""

    arch: ArchConfig
    tied: bool
    score: nn.Module

    def add_lm_head(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        self.tied = False  # there is no LM head; a stray lm_head tensor fails to load
        # Replicated on every rank: [num_labels, hidden] is a few kilobytes.
        self.score = self.make_head(self.arch.hidden_size, self._num_labels())

    def _num_labels(self) -> int:
        num_labels = token_classifier_config(self.arch).num_labels
        assert num_labels is not None
        return num_labels

    def make_head(self, hidden_size: int, num_labels: int) -> nn.Module:
        bias = bool(self.arch.raw.get("token_classification_bias", True))
        return nn.Linear(hidden_size, num_labels, bias=bias)

    def classifier_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] final-normed hidden states -> [N, num_labels] logits."""
        return self.score(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError(
            f"{type(self).__name__} has no LM head; it only scores tokens (runner='pooling')."
        )


class _RewardModel(_TokenClassifier):
    """Qwen's reward heads: two layers, and checkpoints that may keep an LM head."""

    def make_head(self, hidden_size: int, num_labels: int) -> nn.Module:
        return nn.Sequential(
            nn.Linear(hidden_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, num_labels)
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        kept = ((name, t) for name, t in weights if not name.startswith("lm_head."))
        return super().load_weights(kept)  # type: ignore[misc]


class LlamaForTokenClassification(_TokenClassifier, LlamaForCausalLM):
    """``LlamaForTokenClassification`` checkpoints."""


class MistralForTokenClassification(_TokenClassifier, MistralForCausalLM):
    """``MistralForTokenClassification`` checkpoints."""


class Qwen2ForTokenClassification(_TokenClassifier, Qwen2ForCausalLM):
    """``Qwen2ForTokenClassification`` checkpoints."""


class Qwen3ForTokenClassification(_TokenClassifier, Qwen3ForCausalLM):
    """``Qwen3ForTokenClassification`` checkpoints."""


class Qwen2ForRewardModel(_RewardModel, Qwen2ForCausalLM):
    """``Qwen2ForRewardModel`` checkpoints (Qwen2.5-Math-RM: one reward per token)."""


class Qwen2ForProcessRewardModel(_RewardModel, Qwen2ForCausalLM):
    """``Qwen2ForProcessRewardModel`` checkpoints (Qwen2.5-Math-PRM: two labels per step
    tag, STEP pooling)."""
