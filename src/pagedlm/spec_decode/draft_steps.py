"""The one-token-per-request forwards a model-based proposer drafts with.

Draft ``j`` of every proposing request comes from one forward of the draft model (or
EAGLE head) over one token per request, at a position the device knows (after the step's
accepted drafts) and the host may not. ``DraftSteps`` owns persistent device buffers for
those forwards and builds their ``BatchLayout``: positions, lengths and slot mapping are
computed on the device from the positions and the batch's block table; the host copies
of the lengths are exact when the caller knows the positions, else upper bounds (for
backends that read only device tensors, ``AttentionBackend.reads_host_lengths`` False).
The buffers' addresses never change, so the platform can capture these forwards as graphs
(``capture_inputs`` gives the padding-only step a capture runs over).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm.worker.input_batch import InputBatch


class DraftSteps:
    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch
        device = batch.device
        size = batch.max_num_reqs
        self.input_ids = torch.zeros(size, dtype=torch.int32, device=device)
        self.positions = torch.zeros(size, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.slot_mapping = torch.zeros(size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(
            (size, batch.max_blocks_per_req), dtype=torch.int32, device=device
        )
        self._arange = np.arange(size + 1, dtype=np.int32)

    def layout(
        self,
        slots: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        positions_host: np.ndarray,
        padded_num_reqs: int | None = None,
    ) -> BatchLayout:
        """A step feeding ``token_ids[i]`` at ``positions[i]`` (device ``[m]`` each) for the
        request in slot ``slots[i]``; ``positions_host``: the same, or upper bounds. With
        ``padded_num_reqs`` (a captured graph's size) the rows after the real ones are
        padding: token 0 at position 0, no K/V written, nothing attended."""
        batch = self.batch
        num_reqs = len(positions_host)
        self.input_ids[:num_reqs] = token_ids
        self.positions[:num_reqs] = positions
        self.seq_lens[:num_reqs] = positions + 1
        block_size = batch.block_size
        tables = batch.block_table.index_select(0, slots)
        self.block_table[:num_reqs] = tables
        blocks = tables.gather(1, (positions // block_size).long()[:, None])[:, 0]
        self.slot_mapping[:num_reqs] = blocks * block_size + positions % block_size
        rows = padded_num_reqs or num_reqs
        self._pad(num_reqs, rows)
        lens = np.zeros(rows, dtype=np.int32)
        lens[:num_reqs] = positions_host + 1
        return self._layout(rows, lens)

    def capture_inputs(self, num_reqs: int, query_len: int) -> SimpleNamespace:
        """``num_reqs`` padding rows: what a graph of that size is captured over (the
        interface of ``StepInputBuilder.capture_inputs`` that graph runners use)."""
        assert query_len == 1, "drafts are one token per request"
        self._pad(0, num_reqs)
        layout = self._layout(num_reqs, np.zeros(num_reqs, dtype=np.int32))
        return SimpleNamespace(
            input_ids=self.input_ids[:num_reqs], positions=self.positions[:num_reqs], layout=layout
        )

    def gather(self, inputs: object) -> None:
        """Nothing to gather before a replay: ``layout`` writes the buffers itself (the
        interface of ``StepInputBuilder.gather`` that graph runners call)."""

    def _pad(self, start: int, end: int) -> None:
        if end > start:
            self.input_ids[start:end] = 0
            self.positions[start:end] = 0
            self.seq_lens[start:end] = 0
            self.slot_mapping[start:end] = -1
            self.block_table[start:end] = 0

    def _layout(self, rows: int, lens: np.ndarray) -> BatchLayout:
        return BatchLayout(
            num_reqs=rows,
            num_tokens=rows,
            max_query_len=1,
            max_seq_len=int(lens.max(initial=0)),
            block_size=self.batch.block_size,
            query_start_loc=self.query_start_loc[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_table=self.block_table[:rows],
            slot_mapping=self.slot_mapping[:rows],
            query_start_loc_cpu=self._arange[: rows + 1].copy(),
            seq_lens_cpu=lens,
        )
