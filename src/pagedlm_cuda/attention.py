"""The Triton attention backend: paged KV cache on the GPU, one metadata build per step.

``build_metadata`` takes views of the step's layout, which the model runner already keeps
on the device (slot mapping, query offsets, sequence lengths, block tables). ``forward``
runs the decode kernel (split-K, GQA-grouped, writing the new K/V by slot itself) when
every request schedules one token; the verification kernel (split-K over all of a
request's rows at once, writing the new K/V too) when none schedules more than
``verify_attention.MAX_QUERY_LEN`` tokens (speculative verification, short chunks); else
it writes the new K/V by slot and runs the varlen prefill kernel (prompts, long chunks).
All three take a per-layer sliding window, logit soft-cap and attention sinks (gpt-oss).
At up to ``FUSED_ROTARY_MAX_REQS`` requests the decode and verification kernels also
rotate the query and new keys themselves (``fuses_rotary``: one rotary launch per layer
fewer).

Latent layers (``value_dim``: DeepSeek's MLA, one latent "head" per token that is also its
value) run the kernels of ``kernels/latent_attention.py``: split-KV over blocks of heads for
decode and verification steps (a decode writing its new keys itself), flash attention for
longer ones, after a write of the new keys; FP8 caches too, none of the other features.

FP8 cache: the kernels quantize on write and dequantize tiles in registers, with the
layer's per-tensor ``k_scale``/``v_scale`` read from device memory (a graph replays them
in place). Batch-invariant mode (``set_batch_invariant``): the new K/V are always written
first, and every token, decode or prefill row, runs through the decode kernel with one
fixed split (``decode_config.batch_invariant_config``), one "sequence" per token ending
at its own position; only decode-only steps are captured in graphs then.

Cache layout: ``[num_blocks, num_kv_heads, block_size, head_dim]`` per layer (not the
interface's default ``[num_blocks, block_size, num_kv_heads, head_dim]``), so one kv
head's keys of one block are one contiguous ``block_size * head_dim`` run for the kernels
to stream. Slot ``s`` is still offset ``s % block_size`` of block ``s // block_size``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

from pagedlm.attention.backend import AttentionBackend, BatchLayout, FusedRotary
from pagedlm.kv_cache.fp8 import is_fp8

FUSED_ROTARY_ENV = "PAGEDLM_FUSED_ROTARY"
"""``0``: decode steps rotate in the separate rotary kernel again (to measure the fusion)."""

FUSED_ROTARY_MAX_REQS = 8
"""Requests (a CUDA-graph bucket boundary) up to which the decode and verification kernels
rotate q and k themselves. Measured on an H100 (session 19): at batch 1 (W2) the fusion
took W2 from 180.5 to 183.4 tok/s (with the one-row SiLU epilogue); at batch 256 (W1) it
cost 5% (19,299 -> 18,042-18,415 tok/s), the rotation's registers and loads in every
partition's program costing more than the launch it saves."""

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
    token_seq_lens: torch.Tensor | None = None
    """Batch-invariant mode, steps with a chunk: [num_tokens] each token's position + 1."""
    token_block_tables: torch.Tensor | None = None
    """Batch-invariant mode, steps with a chunk: [num_tokens, max_blocks] each token's
    request's block table."""

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


class TritonAttentionBackend(AttentionBackend):
    """Paged attention through the Triton kernels of ``pagedlm_cuda.kernels``."""

    name = "triton"
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_fp8_kv_cache = True
    supports_batch_invariant = True
    supports_non_causal = True
    supports_sinks = True
    supports_latent_kv = True
    reads_host_lengths = False  # kernels read lengths on the device; max_* are bounds

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        """[num_blocks, num_kv_heads, block_size, head_dim]: heads outside slots."""
        return (num_blocks, num_kv_heads, block_size, head_dim)

    @classmethod
    def kv_block_view(
        cls, layer_cache: torch.Tensor, block_size: int, num_kv_heads: int, head_dim: int
    ) -> torch.Tensor:
        """Slots before heads: the cache with its middle dimensions swapped (a view)."""
        return layer_cache.view(-1, num_kv_heads, block_size, head_dim).transpose(1, 2)

    def build_metadata(self, layout: BatchLayout) -> TritonMetadata:
        """Views of the layout's device tensors: nothing is copied, so the same metadata
        serve a captured graph at every replay."""
        metadata = TritonMetadata(
            slot_mapping=layout.slot_mapping,
            query_start_loc=layout.query_start_loc,
            seq_lens=layout.seq_lens,
            block_tables=layout.block_table,
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
        )
        if self.batch_invariant and not metadata.is_decode_only:
            seq_lens, tables = per_token_layout(layout)
            metadata = replace(metadata, token_seq_lens=seq_lens, token_block_tables=tables)
        return metadata

    def supports_graph(self, query_len: int) -> bool:
        # The decode kernel's grid depends only on the batch size and max_seq_len
        # (max_model_len under a graph). A uniform step of a few tokens per request (a
        # speculative verification) runs the verification kernel, sized the same way plus
        # the captured query length, or (longer queries) the prefill kernel, whose grid
        # depends on the batch size and max_query_len only: one row tile.
        if self.batch_invariant:
            return query_len == 1  # chunk steps build per-token tables (copies)
        return 1 <= query_len <= GRAPH_MAX_QUERY_LEN

    def fuses_rotary(self, metadata: TritonMetadata | None, head_dim: int) -> bool:
        # Decode and verification steps: their kernels rotate the query and the new keys
        # they write, which saves the rotary kernel's launch in every layer (a recorded
        # piece of a forward, metadata None, rotates in the piece instead).
        from pagedlm_cuda.kernels.verify_attention import MAX_QUERY_LEN

        if metadata is None or self.batch_invariant or metadata.max_query_len > MAX_QUERY_LEN:
            return False
        if metadata.seq_lens.shape[0] > FUSED_ROTARY_MAX_REQS:
            return False
        if not _rotary_fusion_on():
            return False
        return head_dim >= 16 and not head_dim & (head_dim - 1)

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
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        rotary: FusedRotary | None = None,
        causal: bool = True,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        if value_dim is not None:
            unsupported = {
                "sliding_window": sliding_window is not None,
                "logits_soft_cap": logits_soft_cap is not None,
                "rotary": rotary is not None,
                "causal=False": not causal,
                "sinks": sinks is not None,
                "batch-invariant mode": self.batch_invariant,
            }
            named = [name for name, given in unsupported.items() if given]
            if named:
                raise ValueError(
                    f"the Triton backend's latent attention (value_dim) takes no "
                    f"{', '.join(named)}; a latent layer must not ask for them."
                )
            return self._latent(query, key, value, key_cache, value_cache, metadata, scale,
                                value_dim, k_scale, v_scale)  # fmt: skip
        from pagedlm_cuda.kernels import (
            paged_decode_attention,
            paged_prefill_attention,
            paged_verify_attention,
            write_kv_cache,
        )
        from pagedlm_cuda.kernels.verify_attention import MAX_QUERY_LEN

        scales = dict(k_scale=k_scale, v_scale=v_scale)
        # The attention kernels' arguments: the sinks only when given (a layer without
        # them runs the kernels exactly as before they existed).
        attend = scales if sinks is None else {**scales, "sinks": sinks}
        if is_fp8(key_cache.dtype):
            check_fp8_device(query.device)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if not causal:
            # An encoder's step (whole prompts, one program per request's rows): the same
            # kernel whatever the batch, so batch-invariant mode needs nothing else.
            if rotary is not None:
                raise ValueError("the Triton backend fuses no rotary into bidirectional steps.")
            write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping, **scales)
            return paged_prefill_attention(
                query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                metadata.query_start_loc, scale, metadata.max_query_len, out,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, causal=False,
                **attend,
            )  # fmt: skip
        if self.batch_invariant:
            return self._invariant(
                query, key, value, key_cache, value_cache, metadata, scale, out,
                sliding_window, logits_soft_cap, scales, sinks,
            )  # fmt: skip
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
                rotary=rotary,
                **attend,
            )
        if metadata.max_query_len <= MAX_QUERY_LEN:
            # The verification kernel writes the new K/V itself too.
            return paged_verify_attention(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.query_start_loc,
                scale,
                metadata.max_query_len,
                metadata.max_seq_len,
                out,
                new_kv=(key, value, metadata.slot_mapping),
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                rotary=rotary,
                **attend,
            )
        if rotary is not None:
            raise ValueError("the Triton backend fuses a rotary into steps of <= 8 tokens only.")
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping, **scales)
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
            **attend,
        )

    @staticmethod
    def _latent(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonMetadata,
        scale: float,
        value_dim: int,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """Latent attention: one cache tensor, written once (by the decode kernel itself in
        a decode-only step), read by the latent kernels."""
        from pagedlm_cuda.kernels.latent_attention import (
            paged_latent_attention,
            write_latent_cache,
        )

        if value is not key or value_cache is not key_cache:
            raise ValueError(
                "latent attention (value_dim) takes value=key and value_cache=key_cache: "
                "one latent tensor whose first value_dim features are the values."
            )
        if is_fp8(key_cache.dtype):
            check_fp8_device(query.device)
            if k_scale is None or (v_scale is not None and v_scale is not k_scale):
                raise ValueError("an FP8 latent cache takes k_scale, and v_scale is k_scale.")
        attend = (
            query, key_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, scale, value_dim, metadata.max_query_len,
        )  # fmt: skip
        if metadata.is_decode_only:
            return paged_latent_attention(
                *attend, new_key=key, slot_mapping=metadata.slot_mapping, k_scale=k_scale
            )
        write_latent_cache(key, key_cache, metadata.slot_mapping, k_scale)
        return paged_latent_attention(*attend, k_scale=k_scale)

    @staticmethod
    def _invariant(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TritonMetadata,
        scale: float,
        out: torch.Tensor,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        scales: dict[str, torch.Tensor | None],
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every token through the decode kernel with the fixed split, after the write (so
        the last key is read from the cache like every other, never attended from
        registers, which would sum it in another order)."""
        from pagedlm_cuda.kernels import paged_decode_attention, write_kv_cache
        from pagedlm_cuda.kernels.decode_config import batch_invariant_config

        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping, **scales)
        tables, seq_lens = metadata.block_tables, metadata.seq_lens
        if metadata.token_seq_lens is not None:
            tables, seq_lens = metadata.token_block_tables, metadata.token_seq_lens
        return paged_decode_attention(
            query, key_cache, value_cache, tables, seq_lens, scale, metadata.max_seq_len, out,
            sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
            config=batch_invariant_config(query.shape[-1]), sinks=sinks, **scales,
        )  # fmt: skip


def per_token_layout(layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """([num_tokens] int32 position + 1, [num_tokens, max_blocks] block table) of every
    token of the step, computed on the device without a host sync: token ``t`` of request
    ``i`` is a "sequence" of its own that ends at its position."""
    num_reqs, num_tokens = layout.num_reqs, layout.num_tokens
    device = layout.seq_lens.device
    starts = layout.query_start_loc[: num_reqs + 1].long()
    query_lens = starts[1:] - starts[:-1]
    request = torch.repeat_interleave(
        torch.arange(num_reqs, device=device), query_lens, output_size=num_tokens
    )
    offset = torch.arange(num_tokens, device=device) - starts[request]
    context = layout.seq_lens[:num_reqs].long() - query_lens
    seq_lens = (context[request] + offset + 1).to(torch.int32)
    return seq_lens, layout.block_table[:num_reqs].index_select(0, request)


@functools.cache
def _rotary_fusion_on() -> bool:
    return os.environ.get(FUSED_ROTARY_ENV, "1") != "0"


@functools.cache
def check_fp8_device(device: torch.device) -> None:
    """Triton's float8 E4M3 conversions need compute capability 8.9 (Ada, Hopper) or later
    (checked once per device)."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise ValueError(
            f"kv_cache_dtype='fp8' needs a GPU of compute capability 8.9 or later; {name} "
            "is older. Use kv_cache_dtype='auto'."
        )
