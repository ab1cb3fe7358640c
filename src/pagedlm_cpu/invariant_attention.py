"""Batch-invariant attention on CPU: every query token in its own, identically shaped call.

The fast path (``attention.py``) pads decodes to the batch's longest context and runs
chunks as one causal call each, so a token's reduction depends on its neighbours: the
padded length, the chunk's query length and SDPA's own blocking of both. Here the token at
position ``p`` attends with one query row per head over exactly its keys ``0 .. p`` (its
window's, with a sliding window), read back from the cache, in a call whose shapes depend
on ``p`` alone. Whether it was scheduled alone, in a batch of 256, in a prefill chunk or
as a decode, it therefore meets the same kernel with the same inputs and gives the same
bits. The cost is one SDPA call per token and layer instead of one per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from pagedlm_cpu.sdpa import attend

CpuSdpaMetadata = Any
"""``pagedlm_cpu.attention.CpuSdpaMetadata`` (not imported: that module imports this one)."""

Scales = tuple[torch.Tensor | None, torch.Tensor | None]
ReadBlocks = Callable[
    [int, torch.Tensor, torch.Tensor, torch.dtype, "torch.Tensor | None"], torch.Tensor
]
"""``paged_gather.GatherWorkspaces.read``: (workspace, cache, block ids, dtype, scale) ->
[rows, kv_heads, d]."""


def _requests(metadata: CpuSdpaMetadata) -> Iterator[tuple[list[int], int, torch.Tensor]]:
    """(query rows, position of the first, block ids) of every request of the step."""
    for group in metadata.decode_groups:
        tables = group.block_ids.view(group.num_decodes, -1)
        seq_lens = group.seq_lens.tolist()
        rows = range(group.num_decodes) if group.token_rows is None else group.token_rows.tolist()
        for index, row in enumerate(rows):
            yield [row], seq_lens[index] - 1, tables[index]
    for chunk in metadata.chunks:
        yield list(range(chunk.query_start, chunk.query_end)), chunk.context_len, chunk.block_ids


def attend_per_token(
    read: ReadBlocks,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    metadata: CpuSdpaMetadata,
    scale: float,
    sliding_window: int | None,
    logits_soft_cap: float | None,
    scales: Scales,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [num_tokens, heads, d] -> [num_tokens, heads, d]; the step's K/V are already
    in the caches. Same contract as ``CpuSdpaBackend.forward`` after its write (``sinks``:
    [heads] or None, as there)."""
    output = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[-2]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    row_sinks = None if sinks is None else sinks.view(1, num_kv_heads, group, 1)
    for rows, first_position, block_ids in _requests(metadata):
        num_keys = first_position + len(rows)
        blocks = block_ids[: -(-num_keys // block_size)]
        keys = read(0, key_cache, blocks, query.dtype, scales[0])
        values = read(1, value_cache, blocks, query.dtype, scales[1])
        for offset, row in enumerate(rows):
            end = first_position + offset + 1
            start = 0 if sliding_window is None else max(0, end - sliding_window)
            # [kv_heads, L, d], contiguous: the call sees the same strides and layout for
            # a given L wherever the keys were gathered.
            k = keys[start:end].transpose(0, 1).contiguous()[None]
            v = values[start:end].transpose(0, 1).contiguous()[None]
            q = query[row].view(1, num_kv_heads, group, head_dim)
            out = attend(q, k, v, None, scale, logits_soft_cap, causal=False, sinks=row_sinks)
            output[row] = out.view(num_heads, head_dim)
    return output
