"""The one SDPA call both CPU attention paths make (with an explicit soft-capped variant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    logits_soft_cap: float | None,
    causal: bool = True,
) -> torch.Tensor:
    """query [N, heads, Q, d], key/value [N, kv_heads, S, d] -> [N, heads, Q, d].

    ``mask`` (bool, broadcastable to [N, heads, Q, S], True = attend) or, when None and
    ``causal``, the plain causal mask (Q == S). Soft-capping needs the scores themselves,
    so it takes the explicit path: scores in the activation dtype, softmax in float32.
    """
    if logits_soft_cap is None:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            is_causal=causal and mask is None,
            scale=scale,
            enable_gqa=True,
        )
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if mask is None and causal:
        num_queries, num_keys = scores.shape[-2:]
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)
