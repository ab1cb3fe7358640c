"""The decoding requests' keys and values, kept kv head-major from step to step.

A decode step on CPU attends over keys that the paged cache scatters across blocks; the
backend used to gather every decode's whole context from the cache in every layer of every
step (``index_select`` of its blocks, and for 16 or more bf16 decodes a second copy into
``[requests, kv heads, keys, head_dim]`` order for ``decode_matmuls``). At 32 decodes of
SmolLM2 those two copies took ~10 of an ~89 ms step (torch's profiler, Zen 4), reading the
same keys from DRAM that the attention then reads again.

The mirror keeps, per layer, the decode group's keys and values in that order,
``[rows, kv_heads, width, head_dim]``, across steps. A step whose decode in row ``r`` is the
one row ``r`` held in the step before (the same blocks, one token longer) only appends the
new token: two small copies per layer. Rows whose request changed (a new request, one that
left and moved the others up, a preemption, a different group) are gathered again from
the cache, as before; so is every row of a layer whose mirror missed the previous step.

Invariants:

- Row ``r`` of a layer's mirror holds, at positions ``0 .. seq_len - 1``, exactly the cache
  rows of the group's ``r``-th decode; other positions hold finite values (zeros or keys
  gathered from valid blocks), so masked scores never meet NaNs.
- A layer's mirror is appended to only when it was brought up to date in the plan made
  right before the current one (``generation``); anything else rebuilds its rows.
- The mirror of one layer (keys or values) takes at most ``MAX_FRACTION`` of that layer's
  cache; a step that would need more gathers as before (``read`` returns None).

Blocks of a running request are written only by it (cached full blocks are never written
again), so a row whose block table and length continue the previous step's is still
valid. One instance belongs to one ``CpuSdpaBackend`` (not reentrant, as the backend).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

MAX_FRACTION = 0.25
"""Largest share of a layer's cache one mirror (keys or values) may take."""


def fits(rows: int, width: int, cache_slots: int) -> bool:
    """Whether a mirror of ``rows`` rows of ``width`` key positions stays within
    ``MAX_FRACTION`` of a layer's cache of ``cache_slots`` slots."""
    return rows * width <= MAX_FRACTION * cache_slots


@dataclass
class MirrorPlan:
    """What one step's decode group does to every layer's mirror (made by ``plan``)."""

    generation: int
    num_rows: int
    num_key_slots: int
    width: int
    """Key positions each row holds: ``num_key_slots`` rounded up to whole blocks."""
    rows_kept: np.ndarray
    """[num_rows] bool: the row continues the previous step's row (append only)."""
    slots: np.ndarray
    """[num_rows] the cache slot of each decode's new token."""
    positions: np.ndarray
    """[num_rows] the new token's position (``seq_len - 1``)."""
    block_ids: torch.Tensor
    """[num_rows, max_blocks] long: each decode's block table, for rebuilt rows."""
    indices: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )
    """(kv_heads, width) -> (source rows in the cache, target rows in the mirror) of the
    new tokens, each a [num_rows * kv_heads] index over ``[-1, head_dim]`` views."""


@dataclass
class _Buffer:
    storage: torch.Tensor
    """Flat; the mirror is its first ``rows * kv_heads * width * head_dim`` elements."""
    width: int = 0
    generation: int = -1
    views: tuple[int, torch.Tensor, torch.Tensor] | None = None
    """(rows, the mirror [rows, kv_heads, width, head_dim], its [-1, head_dim] rows) for
    the buffer's current width: made once, not in every layer of every step."""


class DecodeMirror:
    """Per-layer kv head-major copies of one decode group's keys and values (module doc)."""

    def __init__(self) -> None:
        self._generation = 0
        self._last: tuple[np.ndarray, np.ndarray] | None = None
        """(block tables, seq_lens) of the last plan, for the next plan's comparison."""
        self._buffers: dict[tuple[int, int], _Buffer] = {}

    def forget(self) -> None:
        """A step without a plan: the next plan rebuilds every row."""
        self._generation += 1
        self._last = None

    def plan(
        self, tables: np.ndarray, seq_lens: np.ndarray, slots: np.ndarray, block_size: int
    ) -> MirrorPlan:
        """The plan of a step whose one decode group has these block tables ``[rows,
        max_blocks]`` (cut to the longest context's blocks), contexts (after the step)
        and new tokens' slots."""
        self._generation += 1
        rows = len(seq_lens)
        kept = np.zeros(rows, dtype=bool)
        last = self._last
        if last is not None:
            last_tables, last_lens = last
            common = min(rows, len(last_lens))
            width = min(tables.shape[1], last_tables.shape[1])
            needed = -(-last_lens[:common] // block_size)
            same = (tables[:common, :width] == last_tables[:common, :width]) | (
                np.arange(width)[None, :] >= needed[:, None]
            )
            kept[:common] = (seq_lens[:common] == last_lens[:common] + 1) & same.all(axis=1)
        self._last = (tables.copy(), seq_lens.copy())
        return MirrorPlan(
            generation=self._generation,
            num_rows=rows,
            num_key_slots=int(seq_lens[0]) if rows == 1 else tables.shape[1] * block_size,
            width=tables.shape[1] * block_size,
            rows_kept=kept,
            slots=slots.astype(np.int64),
            positions=seq_lens.astype(np.int64) - 1,
            block_ids=torch.from_numpy(tables.astype(np.int64)),
        )

    def read(
        self,
        which: int,
        cache: torch.Tensor,
        plan: MirrorPlan,
        new: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """[rows, kv_heads, num_key_slots, head_dim] the group's keys (``which`` 0) or
        values (1) of the layer whose cache is ``cache`` ([blocks, block_size, kv_heads,
        head_dim], already holding this step's new tokens), brought up to date; None
        where the mirror would exceed ``MAX_FRACTION`` of the cache (the caller gathers).
        ``new``: the step's new tokens themselves ([rows, kv_heads, head_dim] in the
        cache's dtype, what the cache got at the plan's slots), appended from there
        instead of read back from the cache (one copy instead of two).

        The mirror is exactly as wide as the step's blocks (``width``): the batched
        matmuls then read each row's keys as one contiguous matrix per kv head, where a
        wider buffer made ``bmm`` copy them first. A step whose group is wider or narrower
        than the last (the longest context took a block, or left) gathers every row."""
        rows, width = plan.num_rows, plan.width
        if not fits(rows, width, cache.shape[0] * cache.shape[1]):
            return None
        buffer = self._buffer(cache, which, rows, width)
        views = buffer.views
        if views is None or views[0] != rows:
            kv_heads, head_dim = cache.shape[2], cache.shape[3]
            mirror = buffer.storage[: rows * kv_heads * width * head_dim]
            mirror = mirror.view(rows, kv_heads, width, head_dim)
            views = buffer.views = (rows, mirror, mirror.view(-1, head_dim))
        mirror, flat = views[1], views[2]
        if buffer.generation != plan.generation:  # not read yet in this step
            source, target = self._indices(plan, mirror.shape[1], width)
            if new is None:
                new = cache.view(-1, flat.shape[1]).index_select(0, source)
            flat.index_copy_(0, target, new.reshape(-1, flat.shape[1]))
            kept = plan.rows_kept if buffer.generation == plan.generation - 1 else None
            if kept is None or not kept.all():
                self._rebuild(mirror, cache, plan, np.ones(rows, bool) if kept is None else ~kept)
            buffer.generation = plan.generation
        return mirror if width == plan.num_key_slots else mirror[:, :, : plan.num_key_slots]

    def _buffer(self, cache: torch.Tensor, which: int, rows: int, width: int) -> _Buffer:
        """The layer's buffer for keys or values, large enough for ``rows`` rows of
        ``width`` positions in the cache's dtype. A change of width invalidates its rows;
        a new buffer (grown with headroom: first touches cost page faults) holds none."""
        key = (cache.data_ptr(), which)
        buffer = self._buffers.get(key)
        numel = rows * width * cache.shape[2] * cache.shape[3]
        if buffer is None:
            # Dropped with the cache (a worker put to sleep releases its KV cache).
            weakref.finalize(cache, self._buffers.pop, key, None)
        elif buffer.storage.numel() < numel or buffer.storage.dtype != cache.dtype:
            del self._buffers[key], buffer  # the old buffer's memory first
        elif buffer.width != width:
            buffer.width, buffer.generation, buffer.views = width, -1, None
            return buffer
        else:
            return buffer
        buffer = self._buffers[key] = _Buffer(
            torch.empty(numel * 5 // 4, dtype=cache.dtype), width=width
        )
        return buffer

    @staticmethod
    def _indices(plan: MirrorPlan, kv_heads: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache rows, mirror rows) of the new tokens over ``[-1, head_dim]`` views."""
        found = plan.indices.get((kv_heads, width))
        if found is None:
            heads = np.arange(kv_heads, dtype=np.int64)[None, :]
            rows = np.arange(plan.num_rows, dtype=np.int64)[:, None]
            source = plan.slots[:, None] * kv_heads + heads
            target = (rows * kv_heads + heads) * width + plan.positions[:, None]
            found = (torch.from_numpy(source.ravel()), torch.from_numpy(target.ravel()))
            plan.indices[(kv_heads, width)] = found
        return found

    @staticmethod
    def _rebuild(
        mirror: torch.Tensor, cache: torch.Tensor, plan: MirrorPlan, rows: np.ndarray
    ) -> None:
        """Gather ``rows`` (bool mask) of the group from the cache into the mirror."""
        picked = np.flatnonzero(rows)
        if len(picked) == plan.num_rows:
            block_ids = plan.block_ids
        else:
            block_ids = plan.block_ids[torch.from_numpy(picked)]
        count = block_ids.shape[0]
        kv_heads, head_dim = cache.shape[2], cache.shape[3]
        blocks = cache.index_select(0, block_ids.reshape(-1))
        heads = blocks.view(count, -1, kv_heads, head_dim).transpose(1, 2)
        if count == plan.num_rows:
            mirror.copy_(heads)
        else:
            mirror.index_copy_(0, torch.from_numpy(picked), heads)
