"""A batch of decodes attended as two batched matmuls, where SDPA's CPU kernel is slow.

SDPA's flash kernel on CPU works a (request, kv head) at a time: for one query token per
request it costs ~6 us per request and kv head in bf16 whatever the context, 535 us for
32 decodes of SmolLM2 (3 kv heads, 96 keys) where the arithmetic is a few microseconds.
Two batched matmuls over every request at once, scores in float32 for the softmax, take
218 us there, if each (request, kv head)'s keys are one contiguous ``[keys, head_dim]``
matrix: over the usual gather's ``[request, key, kv head, dim]`` rows they took 453.

So the backend copies the gathered keys and values into ``[requests, kv heads, keys,
head_dim]`` order first (``CpuSdpaBackend.attend_by_heads``). In the engine (SmolLM2's
bf16 decode steps of 32 requests at 80-96 keys, torch's profiler) a layer's attention
then takes ~530 us (gathers 2 x 101, copies 2 x 49, the matmuls 115 and 84, the softmax
25) against ~720 (gathers 2 x 80, SDPA 560). Below 16 decodes, and in float32 and float16,
SDPA stays.

The scores are the bf16 matmul's (float32 sums rounded to bf16, as transformers' eager
attention rounds them), so the output differs from SDPA's in the last bits: 0.004-0.008
at most on outputs of order 1.
"""

from __future__ import annotations

import torch

MIN_DECODES = 16
"""Fewest decodes in one call for the matmuls. Per layer, the block gathers, the copies
and the matmuls against the gathers and SDPA (bf16, 96 keys, hot caches, us): 8 decodes
163-165 against 169-179, even; 16 decodes 247 against 338."""

DTYPES = (torch.bfloat16,)
"""Activation dtypes the matmuls serve. Gathers, copy and attention per layer against the
gathers and SDPA (Zen 4, one thread, 32 decodes of 96 keys, us): float32 700 against 591,
float16 2,838 against 2,198 (no native float16 arithmetic there): SDPA stays for both."""


def uses_matmuls(num_decodes: int, dtype: torch.dtype) -> bool:
    return num_decodes >= MIN_DECODES and dtype in DTYPES


def key_bias(key_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A key-padding mask (True: attend) as the float32 scores' additive 0 / -inf."""
    if key_mask is None:
        return None
    bias = torch.zeros(key_mask.shape, dtype=torch.float32, device=key_mask.device)
    return bias.masked_fill_(~key_mask, float("-inf"))


def attend_decodes(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """query [N, kv_heads, group, d], keys/values [N, kv_heads, S, d] (each head's keys
    contiguous), ``bias`` [N, 1, 1, S] or None -> [N, kv_heads, group, d] in query's
    dtype: ``softmax(q k^T * scale + bias) v`` with the softmax in float32."""
    scores = torch.matmul(query, keys.transpose(-1, -2)).float()
    scores = scores.mul_(scale) if bias is None else torch.add(bias, scores, alpha=scale)
    probs = torch.softmax(scores, dim=-1).to(query.dtype)
    return torch.matmul(probs, values)
