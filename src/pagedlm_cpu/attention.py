"""Paged attention on CPU: gather each request's keys and values, then torch SDPA.

Per step, ``build_metadata`` turns the block tables into index tensors and masks once, so
the per-layer work is one scatter (the new K/V), a gather of whole blocks and the
attention itself. A step's decodes skip the gather where they can: one decode whose
blocks are consecutive reads them in place, and a decode group that continues the last
step's reads the ``DecodeMirror`` (its keys kept kv head-major across steps, a token
appended per step). Requests are split in two groups because they want different shapes:

- decodes (one query token each) are padded to the longest context and run as a batched
  SDPA call with a key-padding mask (16 or more bf16 decodes as two batched matmuls over
  their keys copied kv head-major instead: ``decode_matmuls``); a large batch of decodes
  whose contexts differ much is first sorted by context length and cut into up to
  ``MAX_DECODE_GROUPS`` groups of equal size, one call each, so that short contexts are
  not padded to the longest one (``decode_partition``: 256 decodes of 100-564 keys gather
  30% fewer key slots in 4 groups and their SDPA calls take 1.8x less time; 256 prompts of
  100-500 tokens decode 30% faster end to end), unless the ``DecodeMirror`` (above) can hold
  them all as one group: appending to it costs less than gathering the groups;
- chunks of more than one token (prompts, chunked prefills) run one SDPA call each, with a
  causal mask shifted by the request's cached context length; a chunk without cached
  context attends to its own new K/V directly.

An FP8 cache (``kv_cache_dtype="fp8"``) is emulated: the new K/V are quantized on write,
the gathered blocks stay float8 (half the copy) and are dequantized to the compute dtype
just before SDPA; chunks then always read their own K/V back from the cache, so a token
sees the same (quantized) keys whether it is computed in a prefill or in a decode.

Sliding windows (per layer), logit soft-capping (Gemma 2) and bidirectional image spans
(Gemma 3: a chunk's mask also lets positions of one image see each other) change only the
mask and the score function: window masks are built on first use per step and window size, and shared
by every layer with that window; soft-capped scores are computed explicitly, because SDPA
has no hook between the scores and the softmax; so are those of layers with attention
sinks (gpt-oss: a per-head logit joins each softmax's denominator), which the decode
matmuls and ``DecodeOnlyStep`` never see. ``causal=False`` (encoders) drops the causal
mask: every row of a request sees all its keys (a decode's single row already does).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlm.attention.backend import AttentionBackend, BatchLayout
from pagedlm.kv_cache import fp8
from pagedlm_cpu import decode_matmuls, decode_mirror
from pagedlm_cpu.decode_mirror import DecodeMirror, MirrorPlan
from pagedlm_cpu.invariant_attention import attend_per_token
from pagedlm_cpu.sdpa import attend as _attend

DECODE_MIRROR_ENV = "PAGEDLM_CPU_DECODE_MIRROR"
"""Set to 0 to gather every decode's keys from the cache in every layer of every step
instead of keeping them in a ``DecodeMirror``."""
MAX_DECODE_GROUPS = 8
"""Most SDPA calls the step's decodes are split into (``decode_partition``)."""
MIN_DECODE_GROUP = 32
"""Fewest decodes in a group: below, another call costs more than the padding it saves."""
MAX_PADDING = 1.15
"""Decodes stay in one group while their padded key blocks are at most this many times the
blocks they hold."""


def decode_partition(blocks: np.ndarray) -> list[np.ndarray]:
    """Indices into ``blocks`` (each decode's number of key blocks) of the groups attended
    in one call each: all of them in order when one call pads little or the batch is
    small, else sorted by ``blocks`` and cut into equal-sized groups (at least
    ``MIN_DECODE_GROUP`` decodes each, at most ``MAX_DECODE_GROUPS`` groups), the longest
    contexts first: the first group's gather sizes the shared workspace for the others."""
    count = len(blocks)
    num_groups = min(MAX_DECODE_GROUPS, count // MIN_DECODE_GROUP)
    if num_groups <= 1 or count * int(blocks.max()) <= MAX_PADDING * int(blocks.sum()):
        return [np.arange(count)]
    longest_first = np.argsort(-blocks, kind="stable")
    return np.array_split(longest_first, num_groups)


@dataclass(frozen=True)
class DecodeGroup:
    """Requests of the step that schedule exactly one token, attended in one call."""

    num_decodes: int
    token_rows: torch.Tensor | None
    """[num_decodes] their query rows in the flattened batch; None when they are rows
    ``0 .. num_decodes-1`` (no gather needed)."""
    block_ids: torch.Tensor
    """[num_decodes * max_blocks] each decode's block table, cut to ``max_blocks`` (the
    longest one's; shorter tables read valid but unused blocks there, masked out),
    flattened for ``index_select``."""
    key_mask: torch.Tensor | None
    """[num_decodes, 1, 1, max_blocks * block_size] True where the key position exists
    (< seq_len); None when no position is padding."""
    seq_lens: torch.Tensor
    """[num_decodes] each decode's context length after this step (for window masks)."""
    num_key_slots: int
    """The key length attended: ``max_blocks * block_size`` (padding masked out), or the
    one decode's ``seq_len`` (its keys cut to that length, no mask)."""
    block_run: int | None = None
    """The first block when there is one decode and its blocks are consecutive in the cache
    (``block_ids`` is ``first .. first + max_blocks - 1``): its keys and values are then
    read in place, a view of the cache, with no copy."""
    mirror: MirrorPlan | None = None
    """Where the step's one decode group is read from the backend's ``DecodeMirror``
    (its keys kept kv head-major from step to step) instead of gathered: the group's plan;
    None for a block run, several groups, or without the mirror."""
    key_views: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )
    """(workspace, cache dtype) -> (the workspace's rows the blocks are gathered into,
    their [num_decodes, kv_heads, num_key_slots, head_dim] view for SDPA): made by the
    step's first layer, reused by the others (same shapes every layer)."""
    by_heads: dict[object, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    """For ``decode_matmuls`` (made by the step's first layer that uses them): "bias" the
    key mask as the scores' bias, (workspace, cache dtype) the head workspace's
    [num_decodes, kv_heads, num_key_slots, head_dim] view the gathered keys are copied to."""


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


class CpuSdpaBackend(AttentionBackend):
    """Gather + ``scaled_dot_product_attention``; the reference every other backend matches.

    Keys are gathered by whole blocks (``index_select`` of ``[block_size, kv_heads,
    head_dim]`` rows), which copies far larger contiguous pieces than a per-slot gather,
    into two workspaces kept across calls: a fresh multi-MB tensor per layer costs more in
    page faults (transparent huge pages are zeroed on first touch) than the copy itself.
    ``forward`` is therefore not reentrant: one backend instance serves one model runner.
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
        self._workspaces: list[torch.Tensor | None] = [None, None]
        self._head_workspaces: list[torch.Tensor | None] = [None, None]
        self._mirror = (
            DecodeMirror() if os.environ.get(DECODE_MIRROR_ENV, "1") not in ("0", "") else None
        )
        self._cache_slots: int | None = None
        """Slots of one layer's cache, as the last ``forward`` saw it (every request's
        prompt goes through ``forward`` before its first decode)."""

    def build_metadata(self, layout: BatchLayout) -> CpuSdpaMetadata:
        query_lens = layout.query_lens_cpu
        decode_reqs = np.flatnonzero(query_lens == 1)
        spans: dict[int, list[tuple[int, int]]] = {}
        for row, start, end in layout.bidirectional_spans:
            spans.setdefault(row, []).append((start, end))
        chunks = tuple(
            self._chunk(layout, int(i), spans.get(int(i), ()))
            for i in np.flatnonzero(query_lens > 1)
        )
        groups: tuple[DecodeGroup, ...] = ()
        if len(decode_reqs):
            blocks = -(-layout.seq_lens_cpu[decode_reqs] // layout.block_size)
            partition = decode_partition(blocks)
            if len(partition) > 1 and self._mirrors_whole(blocks, layout.block_size):
                partition = [np.arange(len(blocks))]
            groups = tuple(
                self._decode_group(layout, decode_reqs[members]) for members in partition
            )
        if self._mirror is not None:
            groups = self._plan_mirror(layout, decode_reqs, groups)
        return CpuSdpaMetadata(
            slot_mapping=layout.slot_mapping.to(self.device, torch.long),
            decode_groups=groups,
            chunks=chunks,
        )

    def _mirrors_whole(self, blocks: np.ndarray, block_size: int) -> bool:
        """Whether the step's decodes, which ``decode_partition`` would split by length,
        go as one group read from the mirror instead: where the mirror holds them all,
        padded to the longest. Its appends replace the groups' gathers and head-major
        copies in every layer, which cost more than the padded keys the matmuls then read.
        64 decodes of SmolLM2 (bf16, one thread), median decode step, one group against
        the partition's two: 205-228 against 286 ms for prompts of 100-500 tokens (one
        group pads to 1.6x the keys), 255 against 366 for 30-700 (1.9x), 336-341 against
        423 where 8 of the 64 are ~10x longer (5.2x), 379 against 501 at 10.5x
        (docs/performance.md, session 36)."""
        if self._mirror is None or self.batch_invariant or self._cache_slots is None:
            return False
        return decode_mirror.fits(len(blocks), int(blocks.max()) * block_size, self._cache_slots)

    def _plan_mirror(
        self, layout: BatchLayout, reqs: np.ndarray, groups: tuple[DecodeGroup, ...]
    ) -> tuple[DecodeGroup, ...]:
        """``groups`` with the mirror's plan on the one decode group that reads it: a step
        with exactly one group, not read in place, outside batch-invariant mode. Any other
        step makes the mirror forget its rows."""
        mirror = self._mirror
        assert mirror is not None
        if len(groups) != 1 or groups[0].block_run is not None or self.batch_invariant:
            mirror.forget()
            return groups
        group = groups[0]
        seq_lens = layout.seq_lens_cpu[reqs]
        tables = group.block_ids.view(group.num_decodes, -1).cpu().numpy()
        rows = layout.query_start_loc_cpu[reqs]
        slots = layout.slot_mapping.cpu().numpy()[rows]
        plan = mirror.plan(tables, seq_lens, slots, layout.block_size)
        return (dataclasses.replace(group, mirror=plan),)

    def _decode_group(self, layout: BatchLayout, reqs: np.ndarray) -> DecodeGroup:
        block_size = layout.block_size
        seq_lens = layout.seq_lens_cpu[reqs]
        max_blocks = -(-int(seq_lens.max()) // block_size)
        self._check_width(layout, max_blocks)
        rows = layout.query_start_loc_cpu[reqs]
        contiguous = bool((rows == np.arange(len(rows))).all())
        key_mask = None
        seq_lens_t = torch.from_numpy(seq_lens.astype(np.int64)).to(self.device)
        # One decode reads exactly its seq_len keys (a view cut from its blocks), so it
        # needs no mask: SDPA with a mask converts it to scores per layer (two more ops).
        num_key_slots = int(seq_lens[0]) if len(reqs) == 1 else max_blocks * block_size
        if (seq_lens != num_key_slots).any():
            positions = torch.arange(max_blocks * block_size, device=self.device)
            key_mask = (positions < seq_lens_t[:, None])[:, None, None, :]
        # Padding past a table's last needed block reads whatever block id is there: those
        # keys are masked out, and block ids are always valid.
        tables = layout.block_table.to(self.device)[torch.from_numpy(reqs), :max_blocks]
        return DecodeGroup(
            num_decodes=len(reqs),
            token_rows=None if contiguous else self._to_device(rows),
            block_ids=tables.reshape(-1).to(torch.long),
            key_mask=key_mask,
            seq_lens=seq_lens_t,
            num_key_slots=num_key_slots,
            block_run=_block_run(layout, reqs, max_blocks),
        )

    def _chunk(self, layout: BatchLayout, i: int, spans: Sequence[tuple[int, int]]) -> ChunkRequest:
        seq_len = int(layout.seq_lens_cpu[i])
        query_start = int(layout.query_start_loc_cpu[i])
        query_end = int(layout.query_start_loc_cpu[i + 1])
        context_len = seq_len - (query_end - query_start)
        num_blocks = -(-seq_len // layout.block_size)
        self._check_width(layout, num_blocks)
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
            span_mask = span_mask.to(self.device)
        if context_len > 0 or span_mask is not None:
            causal_mask = (key_positions <= query_positions).to(self.device)
            if span_mask is not None:
                causal_mask |= span_mask
        return ChunkRequest(
            query_start=query_start,
            query_end=query_end,
            seq_len=seq_len,
            context_len=context_len,
            block_ids=layout.block_table[i, :num_blocks].to(self.device, torch.long),
            causal_mask=causal_mask,
            span_mask=span_mask,
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
        # Write first: a request may read slots that another request fills in this step.
        _write(key_cache, key, metadata.slot_mapping, k_scale)
        if value_cache is not key_cache:
            _write(value_cache, value, metadata.slot_mapping, v_scale)
        if self.batch_invariant:
            return attend_per_token(
                self._read, query, key_cache, value_cache, metadata, scale,
                sliding_window, logits_soft_cap, (k_scale, v_scale), sinks,
            )  # fmt: skip

        output = None
        for index, group in enumerate(metadata.decode_groups):
            mask = group.key_mask
            if sliding_window is not None:
                mask = _decode_window_mask(metadata, index, sliding_window)
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
            rows = slice(chunk.query_start, chunk.query_end)
            if chunk.context_len == 0 and k_scale is None:
                # No cached context: the keys are exactly this step's, no gather needed.
                k, v = key[rows], value[rows]
            else:
                k = self._read(0, key_cache, chunk.block_ids, query.dtype, k_scale)
                v = self._read(1, value_cache, chunk.block_ids, query.dtype, v_scale)
                k, v = k[: chunk.seq_len], v[: chunk.seq_len]
            mask = chunk.causal_mask if causal else None
            if sliding_window is not None and sliding_window < chunk.seq_len:
                mask = _chunk_window_mask(metadata, index, sliding_window)
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
            output[rows] = out[0].transpose(0, 1)
        return output

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
        for SDPA (``_decode_keys``), then copied kv head-major into a second workspace.
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
            out = self._heads_workspace(which, blocks)
            group.by_heads[(which, cache.dtype)] = out
        return out.copy_(blocks)

    def _heads_workspace(self, which: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of ``like``'s shape and dtype in head workspace ``which``,
        grown as needed (kept across steps, as the gather workspaces are)."""
        numel = like.numel()
        workspace = self._head_workspaces[which]
        if workspace is None or workspace.numel() < numel or workspace.dtype != like.dtype:
            workspace = torch.empty(numel * 5 // 4, dtype=like.dtype, device=like.device)
            self._head_workspaces[which] = workspace
        return workspace[:numel].view(like.shape)

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
            rows = self._read(which, cache, group.block_ids, dtype, scale)
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
            blocks = self._workspace_blocks(which, cache, group.block_ids.shape[0])
            heads = blocks.view(group.num_decodes, -1, num_kv_heads, head_dim)
            heads = heads[:, : group.num_key_slots].transpose(1, 2)
            views = group.key_views[(which, cache.dtype)] = (blocks, heads)
        # The first layer's workspace rows: should a larger gather (a chunk's) replace the
        # workspace later in the step, these rows remain this step's decodes' own.
        torch.index_select(cache, 0, group.block_ids, out=views[0])
        return views[1] if cache.dtype == dtype else views[1].to(dtype)

    def _gather(self, which: int, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[len(block_ids) * block_size, kv_heads, head_dim] the cache rows of the blocks,
        in workspace ``which`` (0 keys, 1 values); valid until the next gather into it."""
        blocks = self._workspace_blocks(which, cache, block_ids.shape[0])
        torch.index_select(cache, 0, block_ids, out=blocks)
        return blocks.view(-1, cache.shape[-2], cache.shape[-1])

    def _workspace_blocks(self, which: int, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """[num_blocks, *cache.shape[1:]] rows of workspace ``which``, grown as needed."""
        numel = num_blocks * cache[0].numel()
        workspace = self._workspaces[which]
        if (
            workspace is None
            or workspace.numel() < numel
            or workspace.dtype != cache.dtype
            or workspace.device != cache.device
        ):
            # Headroom: contexts grow a block at a time, reallocating each time would be
            # the cost the workspace exists to avoid.
            workspace = torch.empty(numel * 5 // 4, dtype=cache.dtype, device=cache.device)
            self._workspaces[which] = workspace
        return workspace[:numel].view(num_blocks, *cache.shape[1:])

    def _read(
        self,
        which: int,
        cache: torch.Tensor,
        block_ids: torch.Tensor,
        dtype: torch.dtype,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The blocks' keys or values in ``dtype`` (dequantized from FP8 with ``scale``)."""
        if scale is None:
            return self._gather(which, cache, block_ids).to(dtype)
        # torch's CPU index kernels have no float8 variants: gather the bytes.
        rows = self._gather(which, cache.view(torch.uint8), block_ids)
        return fp8.dequantize(rows.view(cache.dtype), scale, dtype)

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values.astype(np.int64)).to(self.device)

    @staticmethod
    def _check_width(layout: BatchLayout, num_blocks: int) -> None:
        if layout.block_table.shape[1] < num_blocks:
            raise ValueError(
                f"a request needs {num_blocks} blocks of {layout.block_size} slots but the "
                f"block table has {layout.block_table.shape[1]} columns; the model runner "
                "must pass a block table covering every position."
            )


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


def _write(
    cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor, scale: torch.Tensor | None
) -> None:
    """Store ``new`` [num_tokens, kv_heads, head_dim] at its slots; an FP8 cache gets it
    quantized (saturating), copied as bytes (CPU ``index_copy_`` has no float8 kernel)."""
    rows = cache.view(-1, *new.shape[1:])
    if scale is None:
        rows.index_copy_(0, slot_mapping, new if new.dtype == cache.dtype else new.to(cache.dtype))
    else:
        rows.view(torch.uint8).index_copy_(
            0, slot_mapping, fp8.quantize(new, scale).view(torch.uint8)
        )


def _block_run(layout: BatchLayout, reqs: np.ndarray, max_blocks: int) -> int | None:
    """The first block of the one decode's table when its ``max_blocks`` blocks are
    consecutive in the cache, else None (``DecodeGroup.block_run``)."""
    if len(reqs) != 1:
        return None
    table = layout.block_table[int(reqs[0]), :max_blocks]
    first = int(table[0])
    if max_blocks > 1 and not bool((table.diff() == 1).all()):
        return None
    return first


def _decode_window_mask(metadata: CpuSdpaMetadata, index: int, window: int) -> torch.Tensor:
    """[num_decodes, 1, 1, num_key_slots] of decode group ``index``: key positions
    ``seq_len - window .. seq_len - 1``."""
    key = (-1 - index, window)
    mask = metadata.window_masks.get(key)
    if mask is None:
        group = metadata.decode_groups[index]
        positions = torch.arange(group.num_key_slots, device=group.seq_lens.device)
        seq_lens = group.seq_lens[:, None]
        mask = ((positions < seq_lens) & (positions >= seq_lens - window))[:, None, None, :]
        metadata.window_masks[key] = mask
    return mask


def _chunk_window_mask(metadata: CpuSdpaMetadata, index: int, window: int) -> torch.Tensor:
    """[query_len, seq_len]: row i (position context_len + i) sees keys in
    ``(position - window, position]``, and its span's later keys within the window."""
    key = (index, window)
    mask = metadata.window_masks.get(key)
    if mask is None:
        chunk = metadata.chunks[index]
        device = chunk.block_ids.device
        query_positions = torch.arange(chunk.context_len, chunk.seq_len, device=device)[:, None]
        key_positions = torch.arange(chunk.seq_len, device=device)[None, :]
        visible = key_positions <= query_positions
        if chunk.span_mask is not None:
            visible = visible | chunk.span_mask
        mask = visible & (key_positions > query_positions - window)
        metadata.window_masks[key] = mask
    return mask
