"""Support filters applied after temperature: min-p, then top-k, then top-p.

Each filter masks the logits it rejects to ``-inf`` in place and is skipped entirely when
no row of the batch uses it. Cost model: min-p is one softmax; top-k is one
``torch.topk`` with the largest k of the batch (no full-vocabulary sort); only top-p needs
a sort, and only over the rows that set it.

Tie rule: a token whose logit equals the k-th largest is kept, so top-k may keep more
than k tokens when logits tie exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedlm.sample.host_copy import to_device

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class FilterTensors:
    """Per-row filter parameters of one batch (greedy rows carry neutral values).

    ``min_p``: ``[N]`` float32 (0 = off), or ``None`` when no row sets it.
    ``top_k``: ``[N]`` int64 (0 = off), or ``None`` when no row sets it; ``max_top_k`` is
    its maximum, a Python int so that ``topk`` needs no device sync.
    ``top_p_rows``: ``[R]`` int64 rows that set top-p (``None``: all N do);
    ``top_p``: ``[R]`` float32 in (0, 1), or ``None`` when no row sets it.
    """

    min_p: torch.Tensor | None
    top_k: torch.Tensor | None
    max_top_k: int
    top_p_rows: torch.Tensor | None
    top_p: torch.Tensor | None

    @property
    def is_empty(self) -> bool:
        return self.min_p is None and self.top_k is None and self.top_p is None

    @classmethod
    def build(
        cls,
        min_p: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        vocab_size: int,
        device: torch.device,
    ) -> FilterTensors:
        """Turn per-row values into tensors; ``top_k`` -1 or >= vocab and ``top_p`` 1 mean off."""
        top_k = [k if 0 < k < vocab_size else 0 for k in top_k]
        top_p_rows = [row for row, p in enumerate(top_p) if p < 1.0]
        min_p_tensor = (
            to_device(min_p, torch.float32, device) if any(p > 0.0 for p in min_p) else None
        )
        top_k_tensor = to_device(top_k, torch.int64, device) if any(top_k) else None
        top_p_tensor = (
            to_device([top_p[row] for row in top_p_rows], torch.float32, device)
            if top_p_rows
            else None
        )
        return cls(
            min_p=min_p_tensor,
            top_k=top_k_tensor,
            max_top_k=max(top_k, default=0),
            top_p_rows=(
                None
                if len(top_p_rows) == len(top_p)
                else to_device(top_p_rows, torch.int64, device)
            ),
            top_p=top_p_tensor,
        )


def apply_filters(logits: torch.Tensor, filters: FilterTensors) -> None:
    """min-p, top-k, top-p in that order, in place. ``logits``: ``[N, vocab]`` float32."""
    if filters.min_p is not None:
        apply_min_p(logits, filters.min_p)
    if filters.top_k is not None:
        apply_top_k(logits, filters.top_k, filters.max_top_k)
    if filters.top_p is not None:
        apply_top_p(logits, filters.top_p_rows, filters.top_p)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below ``min_p * max_probability``. ``min_p``: ``[N]``."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> None:
    """Keep each row's ``top_k[i]`` largest logits (0 = keep all). ``top_k``: ``[N]`` int64."""
    kth_index = (top_k.clamp(min=1) - 1).unsqueeze(1)
    kth_largest = logits.topk(max_top_k, dim=-1).values.gather(1, kth_index)
    threshold = kth_largest.masked_fill_(top_k.unsqueeze(1) == 0, _NEG_INF)
    logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_p(logits: torch.Tensor, rows: torch.Tensor | None, top_p: torch.Tensor) -> None:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``.

    ``rows``: ``[R]`` int64 rows to filter (``None`` = all); ``top_p``: ``[R]``. The most
    likely token always survives, even when its probability alone exceeds ``top_p``.
    """
    selected = logits if rows is None else logits[rows]
    ascending, order = selected.sort(dim=-1)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    # Ascending order: drop the low tail whose total mass stays within 1 - top_p.
    drop_sorted = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop_sorted[:, -1] = False
    drop = torch.empty_like(drop_sorted).scatter_(1, order, drop_sorted)
    if rows is None:
        logits.masked_fill_(drop, _NEG_INF)
    else:
        logits.index_copy_(0, rows, selected.masked_fill_(drop, _NEG_INF))
