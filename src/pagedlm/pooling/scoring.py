"""Scoring text pairs (``LLM.score``, /score, /rerank), as vLLM scores them.

A cross-encoder (a classifier with one label) reads each pair as one prompt and its
output is the score; an embedding model (a bi-encoder) embeds each text and the score is
the cosine similarity of the two vectors. ``pair_up`` pairs the two sides: one first text
against every second text (1:N), or element-wise (N:N).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from pagedlm.config import PoolerConfig

T = TypeVar("T")
U = TypeVar("U")


def is_cross_encoder(pooler: PoolerConfig) -> bool:
    return pooler.labels is not None


def pair_up(first: Sequence[T], second: Sequence[U], names: tuple[str, str]) -> list[tuple[T, U]]:
    """Pairs of (first, second): 1:1, 1:N (the one first item against each second one) or
    N:N element-wise; ``names``: the two sides' names for errors."""
    if not first or not second:
        raise ValueError(f"Scoring needs at least one item in {names[0]} and in {names[1]}.")
    if len(first) == 1:
        return [(first[0], item) for item in second]
    if len(first) != len(second):
        raise ValueError(
            f"{names[0]} has {len(first)} items and {names[1]} {len(second)}; pass one "
            f"{names[0]} item (scored against every {names[1]} item) or as many as "
            f"{names[1]} (scored pairwise)."
        )
    return list(zip(first, second, strict=True))


def as_list(data: Any) -> list[Any]:
    """One prompt (a string or a prompt dict) or a sequence of them, as a list."""
    if isinstance(data, (str, dict)):
        return [data]
    return list(data)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity of two float32 vectors (a bi-encoder's score)."""
    return float(F.cosine_similarity(a, b, dim=0))
