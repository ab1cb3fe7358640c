"""Llama-family decoders saved without an LM head (``LlamaModel``, ``Qwen3Model``, ...), as
decoder embedding models (Qwen3-Embedding style) ship them.

The stack is the generative model's; only the head is absent and the checkpoint's tensors
lack the ``model.`` prefix. The pooling runner reads the final-normed hidden states. Each
class is named as the ``architectures`` entry it serves (not to be confused with
``llama.LlamaModel``, the decoder stack inside every one of them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from pagedlm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedlm.model_executor.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)


class _Headless:
    """Mixed into a ``LlamaForCausalLM`` subclass: no LM head, unprefixed tensor names."""

    tied: bool

    def add_lm_head(self, embedding: VocabParallelEmbedding, tied: bool) -> None:
        self.tied = False  # there is no head; a stray lm_head tensor fails to load

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        prefixed = (
            (name if name.startswith("model.") else f"model.{name}", tensor)
            for name, tensor in weights
        )
        return super().load_weights(prefixed)  # type: ignore[misc]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise ValueError(
            f"{type(self).__name__} has no LM head; it only embeds (runner='pooling')."
        )


class LlamaModel(_Headless, LlamaForCausalLM):
    """``LlamaModel`` checkpoints."""


class MistralModel(_Headless, MistralForCausalLM):
    """``MistralModel`` checkpoints."""


class Qwen2Model(_Headless, Qwen2ForCausalLM):
    """``Qwen2Model`` checkpoints."""


class Qwen3Model(_Headless, Qwen3ForCausalLM):
    """``Qwen3Model`` checkpoints."""
