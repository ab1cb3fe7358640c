"""The Triton attention backend: paged KV cache on the GPU, one metadata build per step.

``build_metadata`` packs the step's index arrays (slot mapping, query offsets, sequence
lengths, block tables) into one pinned host buffer and copies it to the device in one
asynchronous transfer. ``forward`` runs the decode kernel (split-K, GQA-grouped, writing
the new K/V by slot itself) when every request schedules one token, else writes the new
K/V by slot and runs the varlen prefill kernel, which also serves mixed batches and
prefix/chunked prefills. Both kernels take a per-layer sliding window and logit soft-cap.

Cache layout: ``[num_blocks, num_kv_heads, block_size, head_dim]`` per layer (not the
interface's default ``[num_blocks, block_size, num_kv_heads, head_dim]``), so one kv
head's keys of one block are one contiguous ``block_size * head_dim`` run for the kernels
to stream. Slot ``s`` is still offset ``s % block_size`` of block ``s // block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedlm.attention.backend import AttentionBackend, BatchLayout


@dataclass(frozen=True)
class TritonMetadata:
    """Device views of one step's layout (all int32)."""

    slot_mapping: torch.Tensor
    """[num_tokens] cache slot of each new token; -1 skips the write (graph padding)."""
    query_start_loc: torch.Tensor
    """[num_reqs + 1] row offsets of each request's queries."""
    seq_lens: torch.Tensor
    """[num_reqs] context length after this step; 0 marks a padding row."""
    block_tables: torch.Tensor
    """[num_reqs, max_blocks] block ids, padded with 0."""
    max_query_len: int
    max_seq_len: int
    """An upper bound of ``seq_lens`` (max_model_len under a CUDA graph)."""

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


SECTION_ALIGN = 4
"""Sections of a packed layout start at multiples of 4 int32 (16 bytes): Triton compiles
a kernel variant per pointer alignment, so unaligned views would recompile mid-run."""


def section_offsets(num_tokens: int, num_reqs: int, width: int) -> tuple[int, int, int, int]:
    """Where ``query_start_loc``, ``seq_lens`` and ``block_tables`` start in a packed
    layout of ``num_tokens`` slots and ``num_reqs`` rows of ``width`` blocks (the slot
    mapping starts at 0), and the packed length."""

    def aligned(n: int) -> int:
        return -(-n // SECTION_ALIGN) * SECTION_ALIGN

    qsl = aligned(num_tokens)
    lens = qsl + aligned(num_reqs + 1)
    tables = lens + aligned(num_reqs)
    return qsl, lens, tables, tables + num_reqs * width


def pack_layout(layout: BatchLayout, num_reqs: int, width: int) -> np.ndarray:
    """The int32 array ``[slot_mapping | query_start_loc | seq_lens | block_tables]`` for
    ``num_reqs`` rows (>= layout.num_reqs; extra rows are padding) of ``width`` blocks,
    each section aligned as ``section_offsets`` says."""
    num_tokens = layout.num_tokens
    pad_tokens = num_reqs - layout.num_reqs  # padding rows are one-token decodes
    total_tokens = num_tokens + pad_tokens
    qsl_at, lens_at, tables_at, length = section_offsets(total_tokens, num_reqs, width)
    packed = np.zeros(length, dtype=np.int32)
    packed[:num_tokens] = layout.slot_mapping
    packed[num_tokens:total_tokens] = -1
    qsl = packed[qsl_at : qsl_at + num_reqs + 1]
    qsl[: layout.num_reqs + 1] = layout.query_start_loc
    qsl[layout.num_reqs + 1 :] = np.arange(num_tokens + 1, total_tokens + 1)
    packed[lens_at : lens_at + layout.num_reqs] = layout.seq_lens
    tables = packed[tables_at:].reshape(num_reqs, width)
    for row, table in enumerate(layout.block_tables):
        n = min(len(table), width)
        tables[row, :n] = table[:n]
    return packed


def unpack(
    buffer: torch.Tensor, num_tokens: int, num_reqs: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views (slot_mapping, query_start_loc, seq_lens, block_tables) of a packed buffer."""
    qsl_at, lens_at, tables_at, length = section_offsets(num_tokens, num_reqs, width)
    return (
        buffer[:num_tokens],
        buffer[qsl_at : qsl_at + num_reqs + 1],
        buffer[lens_at : lens_at + num_reqs],
        buffer[tables_at:length].view(num_reqs, width),
    )


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels of ``pagedlm_cuda.kernels``."""

    name = "triton"
    supports_sliding_window = True
    supports_logits_soft_cap = True

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """[num_blocks, num_kv_heads, block_size, head_dim]: heads outside slots."""
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        seq_lens = layout.seq_lens
        blocks_needed = [-(-s // layout.block_size) for s in seq_lens]
        width = max(blocks_needed, default=1) or 1
        layout_tables = [t[:n] for t, n in zip(layout.block_tables, blocks_needed)]
        layout = BatchLayout(
            layout.query_start_loc, seq_lens, layout_tables, layout.slot_mapping, layout.block_size
        )
        packed = torch.from_numpy(pack_layout(layout, layout.num_reqs, width))
        if self.device.type != "cpu":
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        slots, qsl, lens, tables = unpack(packed, layout.num_tokens, layout.num_reqs, width)
        return TritonMetadata(
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=lens,
            block_tables=tables,
            max_query_len=max(layout.query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        from pagedlm_cuda.kernels import (
            paged_decode_attention,
            paged_prefill_attention,
            write_kv_cache,
        )

        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if metadata.is_decode_only:
            # The decode kernel writes the new K/V itself (one launch per layer).
            return paged_decode_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                metadata.max_seq_len,
                out,
                new_kv=(key, value, metadata.slot_mapping),
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping)
        return paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            scale,
            metadata.max_query_len,
            out,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
