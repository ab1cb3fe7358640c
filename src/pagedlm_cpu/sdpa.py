"""The one SDPA call both CPU attention paths make (with an explicit path for soft caps and
attention sinks)."""

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
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [N, heads, Q, d], key/value [N, kv_heads, S, d] -> [N, heads, Q, d].

    ``mask`` (bool, broadcastable to [N, heads, Q, S], True = attend) or, when None and
    ``causal``, the plain causal mask (Q == S). ``sinks`` (broadcastable to [N, heads, Q,
    1]): each row's sink logit, one more term of its softmax denominator with no value.
    Soft-capping and sinks need the scores themselves, so they take the explicit path:
    scores in the activation dtype, softmax in float32.
    """
    if logits_soft_cap is None and sinks is None:
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
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    if mask is None and causal:
        num_queries, num_keys = scores.shape[-2:]
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=scores.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        # The sink is a last column of the scores, dropped after the softmax.
        column = sinks.to(torch.float32).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores.float(), column], dim=-1), dim=-1)
        probs = probs[..., :-1].to(query.dtype)
    return torch.matmul(probs, value)
