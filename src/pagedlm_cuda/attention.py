"""The Triton attention backend: paged KV cache on the GPU, one metadata build per step.

``build_metadata`` takes views of the step's layout, which the model runner already keeps
on the device (slot mapping, query offsets, sequence lengths, block tables). ``forward``
runs the decode kernel (split-K, GQA-grouped, writing the new K/V by slot itself) when
every request schedules one token, else writes the new K/V by slot and runs the varlen
prefill kernel, which also serves mixed batches and prefix/chunked prefills. Both kernels take a per-layer sliding window and logit soft-cap.

Cache layout: ``[num_blocks, num_kv_heads, block_size, head_dim]`` per layer (not the
interface's default ``[num_blocks, block_size, num_kv_heads, head_dim]``), so one kv
head's keys of one block are one contiguous ``block_size * head_dim`` run for the kernels
to stream. Slot ``s`` is still offset ``s % block_size`` of block ``s // block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.attention.backend import AttentionBackend, BatchLayout

GRAPH_MAX_QUERY_LEN = 64
"""Query lengths a captured graph replays: at most one prefill-kernel row tile (BLOCK_M)."""


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
    """[num_reqs, max_blocks_per_req] block ids (columns past a request's blocks unused)."""
    max_query_len: int
    max_seq_len: int
    """An upper bound of ``seq_lens`` (max_model_len under a CUDA graph)."""

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels of ``pagedlm_cuda.kernels``."""

    name = "triton"
    supports_sliding_window = True
    supports_logits_soft_cap = True
    reads_host_lengths = False  # kernels read lengths on the device; max_* are bounds

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """[num_blocks, num_kv_heads, block_size, head_dim]: heads outside slots."""
        return (num_blocks, num_kv_heads, block_size, head_dim)

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        """Views of the layout's device tensors: nothing is copied, so the same metadata
        serve a captured graph at every replay."""
        return TritonMetadata(
            slot_mapping=layout.slot_mapping,
            query_start_loc=layout.query_start_loc,
            seq_lens=layout.seq_lens,
            block_tables=layout.block_table,
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
        )

    def supports_graph(self, query_len: int) -> bool:
        # The decode kernel's grid depends only on the batch size and max_seq_len
        # (max_model_len under a graph). A uniform step of a few tokens per request (a
        # speculative verification) runs the prefill kernel, whose grid depends on the
        # batch size and max_query_len only: the captured query length, one row tile.
        return 1 <= query_len <= GRAPH_MAX_QUERY_LEN

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
