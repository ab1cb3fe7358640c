"""A step's decodes (requests scheduling exactly one token), grouped into SDPA calls.

Each group is padded to its longest context and attended in one batched call (the CPU
attention backend, ``attention.py``). A large batch of decodes whose contexts differ much
is sorted by length and cut into groups (``decode_partition``), unless the backend's
``DecodeMirror`` can hold them all as one group; the one group of a step that continues
the last step's is read from the mirror (its plan rides on the group), one decode whose
blocks are consecutive in the cache is read in place, every other group is gathered.
Built once per step by ``plan_decode_groups``; every layer of the step reuses the groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm_cpu import decode_mirror
from pagedlm_cpu.decode_mirror import DecodeMirror, MirrorPlan
from pagedlm_cpu.paged_gather import blocks_for

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

    def window_mask(self, window: int) -> torch.Tensor:
        """[num_decodes, 1, 1, num_key_slots]: key positions ``seq_len - window ..
        seq_len - 1`` of each decode."""
        positions = torch.arange(self.num_key_slots, device=self.seq_lens.device)
        seq_lens = self.seq_lens[:, None]
        return ((positions < seq_lens) & (positions >= seq_lens - window))[:, None, None, :]


def plan_decode_groups(
    layout: BatchLayout,
    device: torch.device,
    mirror: DecodeMirror | None,
    cache_slots: int | None,
    batch_invariant: bool,
) -> tuple[DecodeGroup, ...]:
    """The step's decode groups (none without decodes): ``decode_partition``'s, or one
    group where ``mirror`` would hold them all (``_mirrors_whole``), the one group that
    reads the mirror carrying its plan (``_with_mirror_plan``). ``cache_slots``: slots of
    one layer's cache as the backend last saw it (None before its first ``forward``)."""
    reqs = np.flatnonzero(layout.query_lens_cpu == 1)
    groups: tuple[DecodeGroup, ...] = ()
    if len(reqs):
        blocks = -(-layout.seq_lens_cpu[reqs] // layout.block_size)
        partition = decode_partition(blocks)
        if len(partition) > 1 and _mirrors_whole(
            blocks, layout.block_size, mirror, cache_slots, batch_invariant
        ):
            partition = [np.arange(len(blocks))]
        groups = tuple(_decode_group(layout, reqs[members], device) for members in partition)
    if mirror is not None:
        groups = _with_mirror_plan(layout, reqs, groups, mirror, batch_invariant)
    return groups


def _mirrors_whole(
    blocks: np.ndarray,
    block_size: int,
    mirror: DecodeMirror | None,
    cache_slots: int | None,
    batch_invariant: bool,
) -> bool:
    """Whether the step's decodes, which ``decode_partition`` would split by length,
    go as one group read from the mirror instead: where the mirror holds them all,
    padded to the longest. Its appends replace the groups' gathers and head-major
    copies in every layer, which cost more than the padded keys the matmuls then read.
    64 decodes of SmolLM2 (bf16, one thread), median decode step, one group against
    the partition's two: 205-228 against 286 ms for prompts of 100-500 tokens (one
    group pads to 1.6x the keys), 255 against 366 for 30-700 (1.9x), 336-341 against
    423 where 8 of the 64 are ~10x longer (5.2x), 379 against 501 at 10.5x
    (docs/performance.md, session 36)."""
    if mirror is None or batch_invariant or cache_slots is None:
        return False
    return decode_mirror.fits(len(blocks), int(blocks.max()) * block_size, cache_slots)


def _with_mirror_plan(
    layout: BatchLayout,
    reqs: np.ndarray,
    groups: tuple[DecodeGroup, ...],
    mirror: DecodeMirror,
    batch_invariant: bool,
) -> tuple[DecodeGroup, ...]:
    """``groups`` with the mirror's plan on the one decode group that reads it: a step
    with exactly one group, not read in place, outside batch-invariant mode. Any other
    step makes the mirror forget its rows."""
    if len(groups) != 1 or groups[0].block_run is not None or batch_invariant:
        mirror.forget()
        return groups
    group = groups[0]
    seq_lens = layout.seq_lens_cpu[reqs]
    tables = group.block_ids.view(group.num_decodes, -1).cpu().numpy()
    rows = layout.query_start_loc_cpu[reqs]
    slots = layout.slot_mapping.cpu().numpy()[rows]
    plan = mirror.plan(tables, seq_lens, slots, layout.block_size)
    return (dataclasses.replace(group, mirror=plan),)


def _decode_group(layout: BatchLayout, reqs: np.ndarray, device: torch.device) -> DecodeGroup:
    block_size = layout.block_size
    seq_lens = layout.seq_lens_cpu[reqs]
    max_blocks = blocks_for(layout, int(seq_lens.max()))
    rows = layout.query_start_loc_cpu[reqs]
    contiguous = bool((rows == np.arange(len(rows))).all())
    key_mask = None
    seq_lens_t = torch.from_numpy(seq_lens.astype(np.int64)).to(device)
    # One decode reads exactly its seq_len keys (a view cut from its blocks), so it
    # needs no mask: SDPA with a mask converts it to scores per layer (two more ops).
    num_key_slots = int(seq_lens[0]) if len(reqs) == 1 else max_blocks * block_size
    if (seq_lens != num_key_slots).any():
        positions = torch.arange(max_blocks * block_size, device=device)
        key_mask = (positions < seq_lens_t[:, None])[:, None, None, :]
    # Padding past a table's last needed block reads whatever block id is there: those
    # keys are masked out, and block ids are always valid.
    tables = layout.block_table.to(device)[torch.from_numpy(reqs), :max_blocks]
    return DecodeGroup(
        num_decodes=len(reqs),
        token_rows=None if contiguous else torch.from_numpy(rows.astype(np.int64)).to(device),
        block_ids=tables.reshape(-1).to(torch.long),
        key_mask=key_mask,
        seq_lens=seq_lens_t,
        num_key_slots=num_key_slots,
        block_run=_block_run(layout, reqs, max_blocks),
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
