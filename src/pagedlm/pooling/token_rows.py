"""Token-wise pooling on the worker (token_embed, token_classify): each request's rows,
gathered chunk by chunk.

Invariants: the bookkeeping follows the scheduler outputs in the order the steps are
launched (``update`` before the step's ``gather``): a new request, or one resumed after
preemption, starts with no rows; a finished or preempted one is dropped, so rows of a step
still in flight never join a restarted request's. A token-wise request reads nothing from
the prefix cache, so its chunks start at position 0 and follow each other without a gap
(checked). A chunk's rows leave the device in the step that computes them (copied to
pinned host memory behind the step's kernels): the device holds no request's rows
across steps, and a chunk's host rows are read only once a later step's copy (or its
own) has been waited for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedlm.sample.host_copy import tensor_to_device
from pagedlm.step import PoolingSpec, SchedulerOutput


@dataclass
class _Rows:
    """One token-wise request's progress."""

    step_positions: np.ndarray | None
    """STEP pooling: the prompt positions holding the step tag (None: every position)."""
    num_positions: int = 0
    """Prompt positions whose rows were gathered (the next chunk starts here)."""
    chunks: list[torch.Tensor] = field(default_factory=list)
    """Host rows ``[n, width]`` of each chunk gathered, in prompt order."""


@dataclass(frozen=True)
class StepChunks:
    """A step's token-wise rows on the device: ``counts[i]`` rows of ``owners[i]``, in
    batch order, after the head, float32 ``[sum(counts), width]``."""

    values: torch.Tensor
    owners: list[str]
    counts: list[int]


class TokenPooler:
    """The rows of the token-wise requests, gathered across their chunks."""

    def __init__(
        self, head: Callable[[torch.Tensor], torch.Tensor] | None, default_task: str
    ) -> None:
        """``head``: a classifier's, applied to every row (None: raw hidden states);
        ``default_task``: the task of a request without a ``PoolingSpec``."""
        self.head = head
        self.default_task = default_task
        self._requests: dict[str, _Rows] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply a step's request changes."""
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self._requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._requests.pop(new.req_id, None)
            spec = new.pooling or PoolingSpec(self.default_task)
            if not spec.token_wise:
                continue
            if new.num_computed_tokens:
                raise RuntimeError(
                    f"token-wise pooling request {new.req_id!r} starts at position "
                    f"{new.num_computed_tokens}: it must not read the prefix cache."
                )
            positions = None
            if spec.step_tag_id is not None:
                prompt = np.asarray(new.token_ids[: new.num_prompt_tokens])
                positions = np.flatnonzero(prompt == spec.step_tag_id)
            self._requests[new.req_id] = _Rows(positions)

    def gather(
        self,
        hidden: torch.Tensor,
        req_ids: list[str],
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
    ) -> StepChunks | None:
        """The token-wise requests' rows of this step, through the head (None: the step
        runs none). Request ``i``'s chunk is rows ``query_start_loc[i] ..`` of ``hidden``,
        its positions ending at ``seq_lens[i] - 1``."""
        rows: list[np.ndarray] = []
        owners: list[str] = []
        for index, req_id in enumerate(req_ids):
            state = self._requests.get(req_id)
            if state is None:
                continue
            start, end = int(query_start_loc[index]), int(query_start_loc[index + 1])
            first = int(seq_lens[index]) - (end - start)
            if first != state.num_positions:
                raise RuntimeError(
                    f"token-wise pooling request {req_id!r}: this chunk starts at position "
                    f"{first}, the rows gathered so far end at {state.num_positions}."
                )
            state.num_positions = first + end - start
            positions = state.step_positions
            if positions is None:
                rows.append(np.arange(start, end))
            else:
                inside = positions[(positions >= first) & (positions < state.num_positions)]
                rows.append(inside - first + start)
            owners.append(req_id)
        if not owners:
            return None
        index_rows = torch.from_numpy(np.concatenate(rows).astype(np.int64))
        values = hidden.index_select(0, tensor_to_device(index_rows, hidden.device))
        if self.head is not None:
            values = self.head(values)
        return StepChunks(values.float(), owners, [len(r) for r in rows])

    def keep(
        self, chunks: StepChunks, host: torch.Tensor, finishing: list[str]
    ) -> dict[str, list[torch.Tensor]]:
        """Add the step's host rows (``host``: ``chunks.values`` being copied) to their
        requests; returns the chunks of those whose prompt ends (``finishing``), which
        leave the pooler."""
        ending = set(finishing)
        done: dict[str, list[torch.Tensor]] = {}
        for req_id, part in zip(chunks.owners, torch.split(host, chunks.counts), strict=True):
            self._requests[req_id].chunks.append(part)
            if req_id in ending:
                done[req_id] = self._requests.pop(req_id).chunks
        return done
