"""Paged attention on CPU: gather each request's keys and values, then torch SDPA.

Per step, ``build_metadata`` turns the block tables into index tensors and masks once, so
the per-layer work is one scatter (the new K/V), a gather of whole blocks (both in
``paged_gather.py``) and the attention itself. A step's decodes skip the gather where they
can: one decode whose blocks are consecutive reads them in place, and a decode group that
continues the last step's reads the ``DecodeMirror`` (its keys kept kv head-major across
steps, a token appended per step). Requests are split in two groups because they want
different shapes:

- decodes (one query token each; ``decode_groups.py``) are padded to the longest context
  and run as a batched SDPA call with a key-padding mask (16 or more bf16 decodes as two
  batched matmuls over their keys copied kv head-major instead: ``decode_matmuls``); a
  large batch of decodes whose contexts differ much is first sorted by context length and
  cut into up to ``MAX_DECODE_GROUPS`` groups of equal size, one call each, so that short
  contexts are not padded to the longest one (``decode_partition``: 256 decodes of 100-564
  keys gather 30% fewer key slots in 4 groups and their SDPA calls take 1.8x less time;
  256 prompts of 100-500 tokens decode 30% faster end to end), unless the ``DecodeMirror``
  (above) can hold them all as one group: appending to it costs less than gathering the
  groups;
- chunks of more than one token (prompts, chunked prefills; ``prefill_chunks.py``) run one
  SDPA call each, with a causal mask shifted by the request's cached context length; a
  chunk without cached context attends to its own new K/V directly.

An FP8 cache (``kv_cache_dtype="fp8"``) is emulated: the new K/V are quantized on write,
the gathered blocks stay float8 (half the copy) and are dequantized to the compute dtype
just before SDPA; chunks then always read their own K/V back from the cache, so a token
sees the same (quantized) keys whether it is computed in a prefill or in a decode.

Sliding windows (per layer), logit soft-capping (Gemma 2) and bidirectional image spans
(Gemma 3: a chunk's mask also lets positions of one image see each other) change only the
mask and the score function: window masks are built on first use per step and window
size, and shared by every layer with that window; soft-capped scores are computed
explicitly, because SDPA has no hook between the scores and the softmax; so are those of
layers with attention sinks (gpt-oss: a per-head logit joins each softmax's denominator),
which the decode matmuls and ``DecodeOnlyStep`` never see. ``causal=False`` (encoders)
drops the causal mask: every row of a request sees all its keys (a decode's single row
already does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlm.attention.backend import AttentionBackend, BatchLayout
from pagedlm_cpu import decode_matmuls, prefault
from pagedlm_cpu.decode_groups import DecodeGroup, decode_partition, plan_decode_groups
from pagedlm_cpu.decode_mirror import DecodeMirror
from pagedlm_cpu.invariant_attention import attend_per_token
from pagedlm_cpu.paged_gather import GatherWorkspaces, write
from pagedlm_cpu.prefill_chunks import ChunkRequest, chunk_request
from pagedlm_cpu.sdpa import attend as _attend

__all__ = [
    "ChunkRequest",
    "CpuSdpaBackend",
    "CpuSdpaMetadata",
    "DecodeGroup",
    "DecodeOnlyStep",
    "decode_partition",
]

DECODE_MIRROR_ENV = "PAGEDLM_CPU_DECODE_MIRROR"
"""Set to 0 to gather every decode's keys from the cache in every layer of every step
instead of keeping them in a ``DecodeMirror``."""


@dataclass(frozen=True)
class CpuSdpaMetadata:
    slot_mapping: torch.Tensor
    """[num_tokens] where each new token's K/V are written."""
    decode_groups: tuple[DecodeGroup, ...]
    """The step's decodes (``decode_partition``); empty when there are none."""
    chunks: tuple[ChunkRequest, ...]
    window_masks: dict[tuple[int, int], torch.Tensor] = field(
        default_factory=dict, compare=False, repr=False
    )
    """(chunk index, or -1 - i for decode group i; window) -> that group's sliding-window
    mask, filled by the first layer that asks; later layers of the step reuse it."""

    def decode_window_mask(self, index: int, window: int) -> torch.Tensor:
        """Decode group ``index``'s ``DecodeGroup.window_mask``, made once per step."""
        key = (-1 - index, window)
        mask = self.window_masks.get(key)
        if mask is None:
            mask = self.window_masks[key] = self.decode_groups[index].window_mask(window)
        return mask

    def chunk_window_mask(self, index: int, window: int) -> torch.Tensor:
        """Chunk ``index``'s ``ChunkRequest.window_mask``, made once per step."""
        key = (index, window)
        mask = self.window_masks.get(key)
        if mask is None:
            mask = self.window_masks[key] = self.chunks[index].window_mask(window)
        return mask


class CpuSdpaBackend(AttentionBackend):
    """Gather + ``scaled_dot_product_attention``; the reference every other backend matches.

    Keys are gathered by whole blocks into workspaces kept across calls
    (``paged_gather.GatherWorkspaces``), so ``forward`` is not reentrant: one backend
    instance serves one model runner.
    """

    name = "cpu_sdpa"
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_fp8_kv_cache = True
    supports_batch_invariant = True
    supports_non_causal = True
    supports_bidirectional_spans = True
    supports_sinks = True
    supports_latent_kv = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._workspaces = GatherWorkspaces()
        self._mirror = (
            DecodeMirror() if os.environ.get(DECODE_MIRROR_ENV, "1") not in ("0", "") else None
        )
        self._cache_slots: int | None = None
        """Slots of one layer's cache, as the last ``forward`` saw it (every request's
        prompt goes through ``forward`` before its first decode)."""
        self._cache_addresses: set[int] = set()
        """Where the caches ``forward`` wrote start: those whose pages ``prefault`` keeps
        faulted in ahead of the writes."""

    def build_metadata(self, layout: BatchLayout) -> CpuSdpaMetadata:
        spans: dict[int, list[tuple[int, int]]] = {}
        for row, start, end in layout.bidirectional_spans:
            spans.setdefault(row, []).append((start, end))
        chunks = tuple(
            chunk_request(layout, int(i), spans.get(int(i), ()), self.device)
            for i in np.flatnonzero(layout.query_lens_cpu > 1)
        )
        groups = plan_decode_groups(
            layout, self.device, self._mirror, self._cache_slots, self.batch_invariant
        )
        if self._cache_slots and layout.num_tokens:
            # How far into the cache this step writes: its pages are faulted in past that.
            block = int(layout.slot_mapping.max()) // layout.block_size + 1
            fraction = block * layout.block_size / self._cache_slots
            prefault.PREFAULTER.advance(self._cache_addresses, fraction)
        return CpuSdpaMetadata(
            slot_mapping=layout.slot_mapping.to(self.device, torch.long),
            decode_groups=groups,
            chunks=chunks,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: CpuSdpaMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        causal: bool = True,
        sinks: torch.Tensor | None = None,
        value_dim: int | None = None,
    ) -> torch.Tensor:
        if value_dim is not None:
            # Latent attention: the keys are the values, one tensor written once. Attending
            # with the whole key as the value and keeping its value features costs the
            # product over the other features (64 of 576 for DeepSeek), nothing else.
            out = CpuSdpaBackend.forward(
                self, query, key, key, key_cache, key_cache, metadata, scale,
                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                k_scale=k_scale, v_scale=k_scale, causal=causal, sinks=sinks,
            )  # fmt: skip
            return out[..., :value_dim]
        if not causal and (sliding_window is not None or self.batch_invariant):
            raise ValueError(
                "cpu_sdpa has no bidirectional sliding-window or batch-invariant attention; "
                "a layer asks for causal=False together with one of them."
            )
        self._cache_slots = key_cache.shape[0] * key_cache.shape[1]
        addresses = self._cache_addresses
        addresses.add(key_cache.data_ptr())
        addresses.add(value_cache.data_ptr())
        # Write first: a request may read slots that another request fills in this step.
        write(key_cache, key, metadata.slot_mapping, k_scale)
        if value_cache is not key_cache:
            write(value_cache, value, metadata.slot_mapping, v_scale)
        if self.batch_invariant:
            return attend_per_token(
                self._workspaces.read, query, key_cache, value_cache, metadata, scale,
                sliding_window, logits_soft_cap, (k_scale, v_scale), sinks,
            )  # fmt: skip

        output = None
        for index, group in enumerate(metadata.decode_groups):
            mask = group.key_mask
            if sliding_window is not None:
                mask = metadata.decode_window_mask(index, sliding_window)
            out = self._decode(
                query, key_cache, value_cache, group, scale, mask, logits_soft_cap,
                (k_scale, v_scale), sinks,
            )  # fmt: skip
            if output is None:
                if not metadata.chunks and group.token_rows is None and len(out) == len(query):
                    return out  # a pure decode step in one group: SDPA's output is the layer's
                output = torch.empty_like(query)
            if group.token_rows is None:
                output[: group.num_decodes] = out
            else:
                output.index_copy_(0, group.token_rows, out)
        if output is None:
            output = torch.empty_like(query)
        for index, chunk in enumerate(metadata.chunks):
            output[chunk.query_start : chunk.query_end] = self._attend_chunk(
                query, key, value, key_cache, value_cache, metadata, index, scale,
                sliding_window, logits_soft_cap, (k_scale, v_scale), causal, sinks,
            )  # fmt: skip
        return output

    def _attend_chunk(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: CpuSdpaMetadata,
        index: int,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
        scales: tuple[torch.Tensor | None, torch.Tensor | None],
        causal: bool,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """One SDPA call for chunk ``index`` -> [query_len, heads, head_dim] (its rows of
        ``forward``'s output)."""
        chunk = metadata.chunks[index]
        rows = slice(chunk.query_start, chunk.query_end)
        if chunk.context_len == 0 and scales[0] is None:
            # No cached context: the keys are exactly this step's, no gather needed.
            k, v = key[rows], value[rows]
        else:
            k = self._workspaces.read(0, key_cache, chunk.block_ids, query.dtype, scales[0])
            v = self._workspaces.read(1, value_cache, chunk.block_ids, query.dtype, scales[1])
            k, v = k[: chunk.seq_len], v[: chunk.seq_len]
        mask = chunk.causal_mask if causal else None
        if sliding_window is not None and sliding_window < chunk.seq_len:
            mask = metadata.chunk_window_mask(index, sliding_window)
        # [tokens, heads, head_dim] -> [1, heads, tokens, head_dim]: with 3-d inputs
        # torch falls back from its fused CPU kernel to the ~3x slower math path.
        out = _attend(
            query[rows].transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            mask,
            scale,
            logits_soft_cap,
            causal=causal,
            sinks=None if sinks is None else sinks.view(1, -1, 1, 1),
        )
        return out[0].transpose(0, 1)

    def decode_only_step(self, metadata: CpuSdpaMetadata, num_tokens: int) -> DecodeOnlyStep | None:
        """What ``forward`` computes for a step of ``num_tokens`` rows that are all
        decodes attended in one call, in fewer torch calls (``DecodeOnlyStep``); None for
        any other step (chunks, several decode groups, batch-invariant mode)."""
        if self.batch_invariant or metadata.chunks or len(metadata.decode_groups) != 1:
            return None
        group = metadata.decode_groups[0]
        if group.token_rows is not None or group.num_decodes != num_tokens:
            return None
        return DecodeOnlyStep(self, metadata.slot_mapping, group)

    def _decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
        key_mask: torch.Tensor | None,
        logits_soft_cap: float | None,
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One batched SDPA for every single-token query -> [num_decodes, heads, head_dim].

        Grouped-query heads are folded into the query length: query head ``h`` reads kv
        head ``h // group``, so [B, heads, d] viewed as [B, kv_heads, group, d] is a batch
        of ``group``-token queries per kv head, with no causal mask among them (they share
        one position). That avoids SDPA's own GQA expansion.
        """
        num_decodes = group.num_decodes
        if group.token_rows is None:
            q = query if len(query) == num_decodes else query[:num_decodes]
        else:
            q = query.index_select(0, group.token_rows)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = key_cache.shape[-2]
        q = q.reshape(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        plain = (
            key_mask is group.key_mask
            and logits_soft_cap is None
            and scales[0] is None
            and sinks is None
        )
        if plain and self.decodes_by_matmuls(group, q.dtype, key_cache.dtype):
            out = self.attend_by_heads(q, key_cache, value_cache, group, scale)
        else:
            out = _attend(
                q,
                self._decode_keys(0, key_cache, group, query.dtype, scales[0]),
                self._decode_keys(1, value_cache, group, query.dtype, scales[1]),
                key_mask,
                scale,
                logits_soft_cap,
                causal=False,
                # Query heads are folded as q is: head kv * group + g at [kv, g].
                sinks=None if sinks is None else sinks.view(1, num_kv_heads, -1, 1),
            )
        return out.reshape(num_decodes, num_heads, head_dim)  # a view where SDPA allows

    @staticmethod
    def decodes_by_matmuls(
        group: DecodeGroup, dtype: torch.dtype, cache_dtype: torch.dtype
    ) -> bool:
        """Whether ``group``'s decodes (without a window, soft cap, FP8 scales or sinks) go
        through ``decode_matmuls``: many of them, in a 16-bit dtype that is the cache's,
        their keys not read in place."""
        return (
            decode_matmuls.uses_matmuls(group.num_decodes, dtype)
            and group.block_run is None
            and cache_dtype == dtype
        )

    def attend_by_heads(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
        new: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``decode_matmuls.attend_decodes`` over the group's keys and values gathered by
        kv head: query [num_decodes, kv_heads, group, head_dim] -> the same shape (``new``:
        this step's (keys, values), which a mirror may append directly)."""
        if "bias" not in group.by_heads:
            group.by_heads["bias"] = decode_matmuls.key_bias(group.key_mask)
        new_keys, new_values = (None, None) if new is None else new
        return decode_matmuls.attend_decodes(
            query,
            self._keys_heads_major(0, key_cache, group, new_keys),
            self._keys_heads_major(1, value_cache, group, new_values),
            group.by_heads["bias"],
            scale,
        )

    def _keys_heads_major(
        self,
        which: int,
        cache: torch.Tensor,
        group: DecodeGroup,
        new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[num_decodes, kv_heads, num_key_slots, head_dim] the group's keys (``which``
        0) or values (1), each (decode, kv head)'s contiguous: gathered by whole blocks as
        for SDPA (``_decode_keys``), then copied kv head-major into a head workspace.
        Gathering rows of one kv head's ``head_dim`` values straight into that order
        reads the same bytes in 9,216 pieces instead of 192 (32 decodes of 96 keys) and
        took 160-194 us per call in the engine against 72-101 for the blocks plus 36-49
        for the copy. The copy's view is made by the step's first layer; decode groups
        share the workspace, each copying into it right before its own attention. A group
        with a mirror plan reads the mirror, already in this order."""
        mirrored = self._mirrored(which, cache, group, new)
        if mirrored is not None:
            return mirrored
        blocks = self._gather_decode_keys(which, cache, group, cache.dtype)
        out = group.by_heads.get((which, cache.dtype))
        if out is None:
            out = self._workspaces.heads(which, blocks)
            group.by_heads[(which, cache.dtype)] = out
        return out.copy_(blocks)

    def _decode_keys(
        self,
        which: int,
        cache: torch.Tensor,
        group: DecodeGroup,
        dtype: torch.dtype,
        scale: torch.Tensor | None,
        new: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[num_decodes, kv_heads, num_key_slots, head_dim] the decodes' keys (``which``
        0) or values (1) in ``dtype``: a view of the cache for one decode whose blocks are
        consecutive, a view of the ``DecodeMirror`` for a group with a mirror plan (``new``:
        this step's keys or values, which the mirror may append directly), else gathered
        into the workspace through views made once per step (a decode step of a small
        model is dominated by the number of torch calls)."""
        num_kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
        if scale is not None:  # FP8: gathered as bytes, then dequantized
            rows = self._workspaces.read(which, cache, group.block_ids, dtype, scale)
            heads = rows.view(group.num_decodes, -1, num_kv_heads, head_dim)
            return heads[:, : group.num_key_slots].transpose(1, 2)
        mirrored = self._mirrored(which, cache, group, new) if cache.dtype == dtype else None
        if mirrored is not None:
            return mirrored
        if group.block_run is not None:
            count = group.block_ids.shape[0]
            blocks = cache[group.block_run : group.block_run + count]
            heads = blocks.view(1, -1, num_kv_heads, head_dim)[:, : group.num_key_slots]
            heads = heads.transpose(1, 2)
            return heads if cache.dtype == dtype else heads.to(dtype)
        return self._gather_decode_keys(which, cache, group, dtype)

    def _mirrored(
        self,
        which: int,
        cache: torch.Tensor,
        group: DecodeGroup,
        new: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """The group's keys or values from the ``DecodeMirror`` where it has a plan and
        the mirror fits its share of the cache (``new``: this step's, as
        ``DecodeMirror.read`` takes them); None: gather them."""
        if group.mirror is None:
            return None
        assert self._mirror is not None
        return self._mirror.read(which, cache, group.mirror, new)

    def _gather_decode_keys(
        self, which: int, cache: torch.Tensor, group: DecodeGroup, dtype: torch.dtype
    ) -> torch.Tensor:
        """``_decode_keys`` gathered into the workspace (no block run, no FP8 scales)."""
        num_kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
        views = group.key_views.get((which, cache.dtype))
        if views is None:
            blocks = self._workspaces.blocks(which, cache, group.block_ids.shape[0])
            heads = blocks.view(group.num_decodes, -1, num_kv_heads, head_dim)
            heads = heads[:, : group.num_key_slots].transpose(1, 2)
            views = group.key_views[(which, cache.dtype)] = (blocks, heads)
        # The first layer's workspace rows: should a larger gather (a chunk's) replace the
        # workspace later in the step, these rows remain this step's decodes' own.
        torch.index_select(cache, 0, group.block_ids, out=views[0])
        return views[1] if cache.dtype == dtype else views[1].to(dtype)


class DecodeOnlyStep:
    """``CpuSdpaBackend.forward`` for a step whose rows are all decodes of one decode
    group, rows in order, on a cache in the activations' dtype, without a sliding window,
    soft cap, FP8 scales or sinks: the same writes, key views and SDPA call, fewer Python calls.
    Made once per step (``decode_only_step``) and called by every layer of the step.

    Where the one decode's blocks are consecutive its keys are one ``as_strided`` view of
    each layer's cache, the view ``_decode_keys`` makes in four calls; otherwise they are
    gathered into the backend's workspaces through the group's views, as ``forward`` does.
    """

    def __init__(
        self, backend: CpuSdpaBackend, slot_mapping: torch.Tensor, group: DecodeGroup
    ) -> None:
        self.backend = backend
        self.slot_mapping = slot_mapping
        self.group = group
        self.key_mask = group.key_mask
        self._run: tuple[tuple[int, ...], tuple[int, ...], int] | None = None
        self._run_of: tuple[int, ...] | None = None

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """query [T, kv_heads, heads / kv_heads, head_dim] (grouped as ``_decode`` groups
        it), key/value [T, kv_heads, head_dim] -> [T, kv_heads, heads / kv_heads, head_dim];
        both caches in the query's dtype."""
        slots = self.slot_mapping
        key_cache.view(-1, *key.shape[1:]).index_copy_(0, slots, key)
        value_cache.view(-1, *value.shape[1:]).index_copy_(0, slots, value)
        backend, group = self.backend, self.group
        if backend.decodes_by_matmuls(group, query.dtype, key_cache.dtype):
            return backend.attend_by_heads(
                query, key_cache, value_cache, group, scale, (key, value)
            )
        if self.group.block_run is None:
            dtype = query.dtype
            keys = self.backend._decode_keys(0, key_cache, self.group, dtype, None, key)
            values = self.backend._decode_keys(1, value_cache, self.group, dtype, None, value)
        else:
            size, stride, offset = self._block_run_view(key_cache)
            keys = key_cache.as_strided(size, stride, key_cache.storage_offset() + offset)
            values = value_cache.as_strided(size, stride, value_cache.storage_offset() + offset)
        return _attend(query, keys, values, self.key_mask, scale, None, causal=False)

    def _block_run_view(self, cache: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """(size, stride, offset) of ``_decode_keys``' in-place view, for caches of
        ``cache``'s shape and strides (every layer's, in practice: computed once)."""
        of = (*cache.shape, *cache.stride())
        if self._run is None or self._run_of != of:
            group = self.group
            count = group.block_ids.shape[0]
            start = group.block_run
            blocks = cache[start : start + count]
            heads = blocks.view(1, -1, *cache.shape[-2:])[:, : group.num_key_slots]
            view = heads.transpose(1, 2)
            self._run = (
                tuple(view.shape),
                view.stride(),
                view.storage_offset() - cache.storage_offset(),
            )
            self._run_of = of
        return self._run
