"""A step's chunks: requests scheduling several tokens (prompts, chunked prefills).

Each chunk is attended in one SDPA call of its own (the CPU attention backend,
``attention.py``), with a causal mask shifted by the request's cached context length; a
chunk without cached context and without bidirectional spans needs no mask (plain
``is_causal``). Gemma 3's image spans let the positions of one image see each other, later
ones included, which only the mask says. Built once per step by ``chunk_request``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm_cpu.paged_gather import blocks_for


@dataclass(frozen=True)
class ChunkRequest:
    """One request scheduling several tokens: query rows ``query_start .. query_end-1``."""

    query_start: int
    query_end: int
    seq_len: int
    context_len: int
    block_ids: torch.Tensor
    """[ceil(seq_len / block_size)] the blocks holding key positions ``0 .. seq_len-1``."""
    causal_mask: torch.Tensor | None
    """[query_len, seq_len] True where row i may attend (key position <= context_len + i,
    or both in one bidirectional span); None when there is no cached context and no span,
    so plain ``is_causal`` applies."""
    span_mask: torch.Tensor | None = None
    """[query_len, seq_len] True where row i and the key sit in the same bidirectional
    span (what the causal rule alone would hide); None without spans."""

    def window_mask(self, window: int) -> torch.Tensor:
        """[query_len, seq_len]: row i (position context_len + i) sees keys in
        ``(position - window, position]``, and its span's later keys within the window."""
        device = self.block_ids.device
        query_positions = torch.arange(self.context_len, self.seq_len, device=device)[:, None]
        key_positions = torch.arange(self.seq_len, device=device)[None, :]
        visible = key_positions <= query_positions
        if self.span_mask is not None:
            visible = visible | self.span_mask
        return visible & (key_positions > query_positions - window)


def chunk_request(
    layout: BatchLayout, i: int, spans: Sequence[tuple[int, int]], device: torch.device
) -> ChunkRequest:
    """Request ``i`` of the step as a chunk; ``spans``: its bidirectional (start, end)
    position ranges."""
    seq_len = int(layout.seq_lens_cpu[i])
    query_start = int(layout.query_start_loc_cpu[i])
    query_end = int(layout.query_start_loc_cpu[i + 1])
    context_len = seq_len - (query_end - query_start)
    num_blocks = blocks_for(layout, seq_len)
    causal_mask = span_mask = None
    query_positions = torch.arange(context_len, seq_len)[:, None]
    key_positions = torch.arange(seq_len)[None, :]
    if spans:
        span_mask = torch.zeros(seq_len - context_len, seq_len, dtype=torch.bool)
        for start, end in spans:
            span_mask |= (
                (query_positions >= start)
                & (query_positions < end)
                & (key_positions >= start)
                & (key_positions < end)
            )
        span_mask = span_mask.to(device)
    if context_len > 0 or span_mask is not None:
        causal_mask = (key_positions <= query_positions).to(device)
        if span_mask is not None:
            causal_mask |= span_mask
    return ChunkRequest(
        query_start=query_start,
        query_end=query_end,
        seq_len=seq_len,
        context_len=context_len,
        block_ids=layout.block_table[i, :num_blocks].to(device, torch.long),
        causal_mask=causal_mask,
        span_mask=span_mask,
    )
