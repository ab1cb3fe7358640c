"""One step's flattened inputs, built with array operations and kept in persistent buffers.

``StepInputBuilder.build`` turns a ``SchedulerOutput`` into the step's device tensors. The
host computes, vectorized over requests and tokens, each token's position and its flat
indices into the input batch's tables, and sends them in two copies: the layout the model
and a captured graph read (query offsets, sequence lengths, positions), then the gather
indices. The device gathers the input ids from ``InputBatch.token_ids`` (so the tokens the
step in flight samples arrive without the host) and the slot mapping and per-row block
tables from ``InputBatch.block_table``.

Every tensor the model reads, and every index the gathers read, lives at a fixed address (a
prefix of a persistent buffer), so a CUDA graph captured over these buffers replays any
later step of its shape, the gathers included: a step run from a graph leaves them to the
graph (``StepInputBuilder.gather``), so the host queues two copies and a replay. A step run
from a graph of ``padded_num_reqs`` rows gets padding rows: as many tokens each as a real
row, at position 0, no K/V written (slot -1), ``seq_len`` 0, the padding block-table row.

Speculative decoding: a verifying request feeds its last sampled token and ``k`` drafts
(already in its row of the token table) and produces logits at all ``1 + k`` positions.
Under asynchronous scheduling a request's start may count the in-flight step's drafts as
accepted (``SchedulerOutput.num_drafts_in_flight``); that step's rejections are on the
device only. The builder then either waits for them and corrects on the host, when the
attention backend plans from the host lengths or a sampling row needs its exact output
count (penalties, ``min_tokens``), or corrects positions, lengths and gather indices on
the device (``spec_positions.py``), leaving the host lengths as upper bounds; the gathers
(in a graph or not) read the corrected indices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm.multimodal.mrope import FlatPositions, MRopePositions
from pagedlm.step import SchedulerOutput
from pagedlm.worker.host_to_device import HostToDevice
from pagedlm.worker.input_batch import InputBatch, RequestState
from pagedlm.worker.prompt_logprobs import PromptLogprobRows
from pagedlm.worker.spec_positions import (
    InFlightCorrector,
    correct_on_device,
    needs_exact_lengths,
)

ALIGN = 4
"""Sections start at multiples of 4 int32 (16 bytes): Triton compiles a kernel variant per
pointer alignment, so unaligned views would recompile mid-run."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class StepInputs:
    """What one step feeds the model, and which of its rows produce logits."""

    req_ids: list[str]
    states: list[RequestState]
    input_ids: torch.Tensor
    """[num_tokens] int32, padding rows included."""
    positions: torch.Tensor
    """[num_tokens] int32."""
    layout: BatchLayout
    sampled: np.ndarray
    """Indices into ``req_ids`` of the requests that sample this step, in batch order."""
    logits_indices: torch.Tensor | None
    """Hidden-state rows to compute logits for: each sampled request's last ``1 + k`` rows
    (``k`` drafts), then the prompt-logprob rows; None when the sampled rows are exactly the
    first rows (every request feeds one token and samples)."""
    sample_token_index: torch.Tensor
    """[len(sampled)] flat indices into ``InputBatch.token_ids`` where each sampled
    request's first output goes (a verifying request's others follow it)."""
    num_drafts: np.ndarray
    """[num_reqs] drafts each request verifies (zeros without speculative decoding)."""
    token_index: torch.Tensor
    """[num_tokens] flat indices into ``InputBatch.token_ids`` of the tokens fed."""
    prompt_logprob_rows: list[PromptLogprobRows]
    prompt_target_index: torch.Tensor | None
    """Flat indices into ``InputBatch.token_ids`` of the next prompt token of every
    prompt-logprob row, or None."""
    seq_lens: np.ndarray
    """[num_reqs] each request's length after the step, drafts included (no padding); an
    upper bound unless ``exact_lengths``."""
    padded_num_reqs: int | None
    """The captured graph size this step runs at, or None (eager)."""
    gather_indices: torch.Tensor
    """The device index buffer ``gather`` reads (see ``_Sections``)."""
    sections: _Sections
    exact_lengths: bool = True
    """False when in-flight rejections were subtracted on the device only: the device
    positions and lengths are right, the host ``seq_lens`` (and the layout's) too long."""

    @property
    def num_sampling_rows(self) -> np.ndarray:
        """[len(sampled)] logits rows per sampled request: ``1 + k``."""
        return 1 + self.num_drafts[self.sampled]


class StepInputBuilder:
    """Owns the persistent step buffers of one model runner (see the module docstring)."""

    def __init__(
        self,
        batch: InputBatch,
        max_num_tokens: int,
        host_lengths_exact: bool = True,
        rope_positions: FlatPositions | MRopePositions | None = None,
        in_flight_corrector: InFlightCorrector | None = None,
        gatherer: StepGatherer | None = None,
    ) -> None:
        """``host_lengths_exact``: the attention backend plans from the layout's host
        lengths, so in-flight rejections are always resolved on the host.
        ``rope_positions``: what the model's rotary reads for a token index (M-RoPE models'
        per-request tables; default: the index itself). ``in_flight_corrector``: the
        platform's kernel for ``correct_on_device`` (None: the torch ops).
        ``gatherer``: the platform's kernel for ``gather_on_device`` (None: the torch ops)."""
        self.batch = batch
        self.correct_on_device = in_flight_corrector or correct_on_device
        self.gatherer = gatherer or gather_on_device
        self.rope_positions = rope_positions or FlatPositions()
        self.host_lengths_exact = host_lengths_exact
        device = batch.device
        max_reqs = batch.max_num_reqs
        self.max_num_tokens = max_num_tokens
        self._lens_at = _aligned(max_reqs + 1)
        self._positions_at = self._lens_at + _aligned(max_reqs)
        self._layout = HostToDevice(
            self._positions_at + max_num_tokens, torch.int32, device, fixed=True
        )
        # token, block and offset indices for every token, then per row: slots, sampled
        # rows, in-flight flags and sampled indices; logits rows and prompt-logprob targets
        # are at most one per token each (a sampling row is never a prompt-logprob row).
        self._indices = HostToDevice(
            5 * max_num_tokens + 4 * max_reqs, torch.int32, device, fixed=True
        )
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            (max_reqs, batch.max_blocks_per_req), dtype=torch.int32, device=device
        )

    def build(
        self,
        scheduler_output: SchedulerOutput,
        padded_num_reqs: int | None = None,
        num_rejected: torch.Tensor | None = None,
    ) -> StepInputs:
        """The step's inputs; ``padded_num_reqs`` rows when it replays a captured graph
        (the batch is then uniform and each padding row feeds as many tokens as a real one).
        ``num_rejected`` ([max_num_reqs] int32 on the device, by slot): the drafts each
        request's last verification rejected, needed when ``num_drafts_in_flight`` is set."""
        batch = self.batch
        req_ids = scheduler_output.req_ids
        states = list(map(batch.requests.__getitem__, req_ids))
        scheduled = scheduler_output.num_scheduled_tokens
        starts = np.array(scheduler_output.num_computed_tokens, dtype=np.int64)
        num_new = np.fromiter(map(scheduled.__getitem__, req_ids), np.int64, len(req_ids))
        drafts = scheduler_output.scheduled_spec_decode_tokens
        num_drafts = np.zeros(len(req_ids), dtype=np.int64)
        if drafts:
            num_drafts[:] = [len(drafts.get(r, ())) for r in req_ids]
        in_flight = None
        if scheduler_output.num_drafts_in_flight:
            assert num_rejected is not None, "in-flight drafts need the rejection counts"
            in_flight = self._in_flight(scheduler_output, states, starts, num_rejected)
        pad_len = int(num_new[0]) if len(num_new) else 1
        return self._build(
            req_ids, states, starts, num_new, num_drafts, padded_num_reqs, pad_len, in_flight
        )

    def _in_flight(
        self,
        scheduler_output: SchedulerOutput,
        states: list[RequestState],
        starts: np.ndarray,
        num_rejected: torch.Tensor,
    ) -> tuple[np.ndarray, torch.Tensor] | None:
        """Resolve the in-flight step's rejections: on the host (``starts`` corrected in
        place; returns None) or later on the device (returns the requests' mask and the
        per-slot counts)."""
        counts = scheduler_output.num_drafts_in_flight
        mask = np.fromiter((s.req_id in counts for s in states), bool, len(states))
        if self.host_lengths_exact or needs_exact_lengths(states, starts, mask, counts):
            slots = [s.slot for s, m in zip(states, mask, strict=True) if m]
            # Waits for the in-flight step (free where the device is the host).
            starts[mask] -= num_rejected[slots].cpu().numpy()
            return None
        return mask, num_rejected

    def token_buffers(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The input ids and positions of a step of ``num_tokens`` tokens: the prefixes of
        the persistent buffers that every step's ``input_ids`` and ``positions`` are."""
        start = self._positions_at
        return self.input_ids[:num_tokens], self._layout.device[start : start + num_tokens]

    def capture_inputs(self, num_reqs: int, query_len: int) -> StepInputs:
        """A step of ``num_reqs`` padding rows of ``query_len`` tokens each, written into the
        persistent buffers: what a graph of that shape is captured over."""
        empty = np.zeros(0, dtype=np.int64)
        return self._build([], [], empty, empty, empty, num_reqs, query_len, None)

    def _build(
        self,
        req_ids: list[str],
        states: list[RequestState],
        starts: np.ndarray,
        num_new: np.ndarray,
        num_drafts: np.ndarray,
        padded_num_reqs: int | None,
        pad_len: int,
        in_flight: tuple[np.ndarray, torch.Tensor] | None,
    ) -> StepInputs:
        batch = self.batch
        num_reqs = len(req_ids)
        slots = np.fromiter(map(_slot, states), np.int64, num_reqs)
        seq_lens = starts + num_new
        num_tokens = int(num_new.sum())
        rows = padded_num_reqs or num_reqs
        total = num_tokens + (rows - num_reqs) * pad_len

        qsl, lens, positions, device_layout = self._stage_layout(
            req_ids, num_new, starts, seq_lens, rows, pad_len
        )
        # A request samples once the tokens it feeds, drafts aside, reach past those it had
        # when admitted: every step after its prompt.
        first_output = seq_lens - num_drafts
        sampled = np.flatnonzero(first_output >= batch.num_admitted_tokens[slots])
        prompt_rows, prompt_row_index, prompt_target_index = _prompt_logprob_rows(
            states if batch.num_prompt_logprob_requests else [],
            starts,
            seq_lens,
            qsl,
            slots,
            batch.row_length,
        )
        uniform_decode = len(sampled) == num_reqs == num_tokens and not prompt_rows
        logits_rows = None
        if not uniform_decode:
            logits_rows = np.concatenate(
                [
                    _last_rows(qsl[1 : num_reqs + 1][sampled], 1 + num_drafts[sampled]),
                    prompt_row_index,
                ]
            )
        sections = _Sections(
            total,
            rows,
            len(sampled),
            0 if logits_rows is None else len(logits_rows),
            0 if in_flight is None else num_reqs,
        )
        token_req = np.repeat(np.arange(num_reqs), num_new)
        indices = self._stage_indices(
            sections,
            slots[token_req],
            positions,
            slots,
            logits_rows,
            slots[sampled] * batch.row_length + first_output[sampled],
            prompt_target_index,
            (in_flight[0], sampled) if in_flight is not None else None,
        )
        if in_flight is not None:
            self.correct_on_device(
                sections.view(indices, "token"),
                sections.view(indices, "block"),
                sections.view(indices, "offset"),
                sections.view(indices, "sample"),
                sections.view(indices, "slots")[:num_reqs],
                sections.view(indices, "in_flight"),
                sections.view(indices, "sampled"),
                device_layout[self._lens_at : self._lens_at + num_reqs],
                device_layout[self._positions_at : self._positions_at + num_tokens],
                device_layout[: num_reqs + 1],
                in_flight[1],
                batch.row_length,
                batch.max_blocks_per_req,
                batch.block_size,
            )
        batch.flush()

        max_query_len = int(num_new.max(initial=0))
        layout = BatchLayout(
            num_reqs=rows,
            num_tokens=total,
            max_query_len=max(max_query_len, pad_len if rows > num_reqs else 0),
            max_seq_len=int(seq_lens.max(initial=0)),
            block_size=batch.block_size,
            query_start_loc=device_layout[: rows + 1],
            seq_lens=device_layout[self._lens_at : self._lens_at + rows],
            block_table=self.block_table[:rows],
            slot_mapping=self.slot_mapping[:total],
            query_start_loc_cpu=qsl.copy(),
            seq_lens_cpu=lens.copy(),
        )
        step = StepInputs(
            req_ids=req_ids,
            states=states,
            input_ids=self.input_ids[:total],
            positions=device_layout[self._positions_at : self._positions_at + total],
            layout=layout,
            sampled=sampled,
            logits_indices=None if uniform_decode else sections.view(indices, "logits"),
            sample_token_index=sections.view(indices, "sample"),
            prompt_logprob_rows=prompt_rows,
            prompt_target_index=sections.view(indices, "targets") if prompt_rows else None,
            seq_lens=seq_lens,
            padded_num_reqs=padded_num_reqs,
            num_drafts=num_drafts,
            token_index=sections.view(indices, "token"),
            gather_indices=indices,
            sections=sections,
            exact_lengths=in_flight is None,
        )
        if padded_num_reqs is None:
            self.gather(step)
        return step

    def _stage_layout(
        self,
        req_ids: list[str],
        num_new: np.ndarray,
        starts: np.ndarray,
        seq_lens: np.ndarray,
        rows: int,
        pad_len: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, torch.Tensor]:
        """Write [query_start_loc | seq_lens | positions] and queue their copy; returns the
        host query offsets, sequence lengths and (unpadded) token indices, and the device
        buffer. The positions written are the rotary's (``rope_positions``), the indices
        returned address the token and block tables."""
        num_reqs = len(num_new)
        num_tokens = int(num_new.sum())
        total = num_tokens + (rows - num_reqs) * pad_len
        host = self._layout.host(self._positions_at + total)
        qsl = host[: rows + 1]
        qsl[0] = 0
        np.cumsum(num_new, out=qsl[1 : num_reqs + 1])
        qsl[num_reqs + 1 :] = num_tokens + pad_len * np.arange(1, rows - num_reqs + 1)
        lens = host[self._lens_at : self._lens_at + rows]
        lens[:num_reqs] = seq_lens
        lens[num_reqs:] = 0
        positions = np.arange(num_tokens) + np.repeat(starts - qsl[:num_reqs], num_new)
        host_positions = host[self._positions_at : self._positions_at + total]
        host_positions[:num_tokens] = self.rope_positions.text_positions(
            req_ids, starts, num_new, positions
        )
        host_positions[num_tokens:] = 0
        return qsl, lens, positions, self._layout.copy(self._positions_at + total)

    def _stage_indices(
        self,
        sections: _Sections,
        token_slots: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        logits_rows: np.ndarray | None,
        sample_index: np.ndarray,
        prompt_target_index: np.ndarray,
        in_flight: tuple[np.ndarray, np.ndarray] | None,
    ) -> torch.Tensor:
        """Write and queue the gather indices (see ``_Sections`` for their order);
        ``in_flight``: (the requests' in-flight mask, the sampled requests' indices)."""
        batch = self.batch
        num_tokens = len(positions)
        host = self._indices.host(sections.length + len(prompt_target_index))
        width = batch.max_blocks_per_req
        token_index = sections.host(host, "token")
        token_index[:num_tokens] = token_slots * batch.row_length + positions
        token_index[num_tokens:] = 0
        block_index = sections.host(host, "block")
        block_index[:num_tokens] = token_slots * width + positions // batch.block_size
        block_index[num_tokens:] = batch.padding_slot * width
        block_offset = sections.host(host, "offset")
        block_offset[:num_tokens] = positions % batch.block_size
        block_offset[num_tokens:] = -1  # the padding row's block 0: slot 0 * size - 1 = -1
        req_slots = sections.host(host, "slots")
        req_slots[: len(slots)] = slots
        req_slots[len(slots) :] = batch.padding_slot
        sections.host(host, "sample")[:] = sample_index
        if logits_rows is not None:
            sections.host(host, "logits")[:] = logits_rows
        if in_flight is not None:
            sections.host(host, "in_flight")[:] = in_flight[0]
            sections.host(host, "sampled")[:] = in_flight[1]
        host[sections.length :] = prompt_target_index
        return self._indices.copy(sections.length + len(prompt_target_index))

    def gather(self, step: StepInputs) -> None:
        """Queue the gathers of ``step``'s input ids, slot mapping and per-row block tables
        from the batch's tables. ``build`` runs them for an eager step; a captured graph
        runs them itself (they read and write only persistent buffers)."""
        batch = self.batch
        sections, indices = step.sections, step.gather_indices
        total, rows = sections.total, sections.rows
        self.gatherer(
            token_table=batch.token_ids.view(-1),
            token_index=sections.view(indices, "token"),
            block_table=batch.block_table,
            block_index=sections.view(indices, "block"),
            block_offset=sections.view(indices, "offset"),
            slots=sections.view(indices, "slots"),
            input_ids=self.input_ids[:total],
            slot_mapping=self.slot_mapping[:total],
            row_tables=self.block_table[:rows],
            block_size=batch.block_size,
        )


StepGatherer = Callable[..., None]
"""A kernel doing what ``gather_on_device`` does, called with the same arguments; a
platform may provide one (``Platform.step_gatherer``)."""


def gather_on_device(
    token_table: torch.Tensor,
    token_index: torch.Tensor,
    block_table: torch.Tensor,
    block_index: torch.Tensor,
    block_offset: torch.Tensor,
    slots: torch.Tensor,
    input_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    row_tables: torch.Tensor,
    block_size: int,
) -> None:
    """A step's inputs from the batch's tables, into persistent buffers (int32 throughout).

    For each of the step's ``T`` tokens: ``input_ids[t] = token_table[token_index[t]]`` (the
    flat token table), ``slot_mapping[t] = block_table.view(-1)[block_index[t]] * block_size
    + block_offset[t]``; for each of its ``R`` rows, ``row_tables[r] =
    block_table[slots[r]]`` (``block_table`` ``[num_slots, W]``, ``row_tables`` ``[R, W]``).
    """
    torch.index_select(token_table, 0, token_index, out=input_ids)
    torch.index_select(block_table.view(-1), 0, block_index, out=slot_mapping)
    slot_mapping.mul_(block_size).add_(block_offset)
    torch.index_select(block_table, 0, slots, out=row_tables)


class _Sections:
    """Where each gather index lives in the packed index buffer:
    ``[token | block | offset]`` (``total`` each), ``slots`` (``rows``), ``sample``,
    ``logits``, with in-flight drafts to correct on the device ``in_flight`` (a 0/1 per
    request) and ``sampled`` (the sampled requests' indices), then the prompt-logprob
    targets."""

    def __init__(
        self, total: int, rows: int, num_sampled: int, num_logits: int, num_in_flight: int
    ) -> None:
        self.total = total
        self.rows = rows
        sizes = {
            "token": total,
            "block": total,
            "offset": total,
            "slots": rows,
            "sample": num_sampled,
            "logits": num_logits,
            "in_flight": num_in_flight,
            "sampled": num_sampled if num_in_flight else 0,
        }
        self.spans: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in sizes.items():
            self.spans[name] = (offset, offset + size)
            offset += size
        self.spans["targets"] = (offset, -1)
        self.length = offset

    def host(self, host: np.ndarray, name: str) -> np.ndarray:
        start, end = self.spans[name]
        return host[start:end]

    def view(self, device: torch.Tensor, name: str) -> torch.Tensor:
        start, end = self.spans[name]
        return device[start:] if end < 0 else device[start:end]


_slot = attrgetter("slot")


def _last_rows(ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The last ``counts[i]`` rows before each ``ends[i]``, in order, concatenated."""
    if len(counts) == 0 or counts.max() == 1:
        return ends - 1
    firsts = np.repeat(ends - counts, counts)
    return firsts + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def _prompt_logprob_rows(
    states: list[RequestState],
    starts: np.ndarray,
    seq_lens: np.ndarray,
    qsl: np.ndarray,
    slots: np.ndarray,
    row_length: int,
) -> tuple[list[PromptLogprobRows], np.ndarray, np.ndarray]:
    """Rows whose next token is a prompt token, for requests that asked for prompt
    logprobs: (per request, their hidden-state rows, the flat token-table indices of the
    tokens they predict)."""
    per_request: list[PromptLogprobRows] = []
    rows: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    for index, state in enumerate(states):
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        start = int(starts[index])
        last = min(int(seq_lens[index]), state.num_prompt_tokens - 1)
        if start >= last:
            continue
        positions = np.arange(start, last)
        per_request.append(PromptLogprobRows(state.req_id, k, last - start))
        rows.append(qsl[index] + positions - start)
        targets.append(int(slots[index]) * row_length + positions + 1)
    if not rows:
        empty = np.zeros(0, dtype=np.int64)
        return per_request, empty, empty
    return per_request, np.concatenate(rows), np.concatenate(targets)
