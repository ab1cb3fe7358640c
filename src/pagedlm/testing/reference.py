"""Attention in float64, the reference every backend is measured against."""

from __future__ import annotations

import torch


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one request's queries over its keys, in float64.

    query: [num_queries, num_heads, head_dim]; key, value: [seq_len, num_kv_heads,
    head_dim] (every position of the request); query_positions: [num_queries], each
    query's position in the sequence. Query head ``h`` reads KV head ``h // (num_heads //
    num_kv_heads)``. Returns [num_queries, num_heads, head_dim] float64.
    """
    query, key, value = query.double(), key.double(), value.double()
    group = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(group, dim=1)
    value = value.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,shd->hqs", query, key) * scale
    if logits_soft_cap is not None:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    key_positions = torch.arange(key.shape[0])[None, :]
    query_positions = query_positions.to(torch.long)[:, None]
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible &= key_positions > query_positions - sliding_window
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqs,shd->qhd", probs, value)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN or infinity anywhere counts as infinite."""
    out64 = out.detach().double().cpu()
    if not torch.isfinite(out64).all():
        return float("inf")
    ref64 = ref.double().cpu()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
