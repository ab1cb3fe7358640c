"""A worker's custom logits processors and the batch they were last told about.

``update(requests)`` diffs a step's sampled requests (in logits-row order) against the
last batch into one ``BatchUpdate`` that keeps the interface's promises: removals first,
additions only at free indices (the lowest ones), then moves (to a free index, or swaps)
that put every request at its row. Each request stays at its index while the order holds,
so a decode batch costs one list comparison per step.

A processor's exception never leaves here: it fails requests, not the engine.
``take_failures`` reports, after a step's sampling, each failed row with its message. A
per-request callable that fails (``AdapterLogitsProcessor.take_failed_rows``) fails its
row alone; a batch processor whose ``update_state`` or ``apply`` raises (or returns no
logits of the batch's shape) cannot say which request it failed on, so it fails every row
of the step, which keeps the logits it was given. One whose ``update_state`` raised may
hold any part of that update: it is not applied in that step, and its next update removes
every index it may hold and adds the whole batch again.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedlm.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from pagedlm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class BatchRequest(NamedTuple):
    """One sampled row's request; ``key`` is unique over the worker's lifetime."""

    key: int
    params: SamplingParams
    prompt_token_ids: list[int] | None
    output_token_ids: list[int]


class CustomLogitsProcessors:
    """Invariant: after ``update(requests)``, request ``requests[i]`` is at index ``i`` of
    every processor's batch, and no other index is occupied."""

    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = tuple(processors)
        invariant = [bool(p.is_argmax_invariant()) for p in self.processors]
        self._positions = {
            kind: tuple(i for i, flag in enumerate(invariant) if flag is kind)
            for kind in (True, False)
        }
        """Argmax-invariant (True) or not: the positions of those processors, in order."""
        self._order: list[int] = []
        """The keys of the last batch, by index."""
        self._batch_size = 0
        self._failures: dict[int, str] = {}
        self._resync: dict[int, int] = {}
        """Position in ``processors`` -> bound on the indices it may hold, for those whose
        ``update_state`` raised: told the whole batch afresh at the next update."""

    def update(self, requests: Sequence[BatchRequest]) -> None:
        """Tell every processor the batch of a step about to be sampled."""
        previous_size = len(self._order)
        batch_update = self._diff(requests)
        self._batch_size = len(requests)
        self._failures = {}
        for position, processor in enumerate(self.processors):
            update = batch_update
            held = self._resync.pop(position, None)
            if held is not None:
                update = _afresh(requests, held)
            try:
                processor.update_state(update)
            except Exception as exc:
                self._fail_batch(processor, "update_state", exc)
                self._resync[position] = max(previous_size, len(requests), held or 0)
            self._take_failed_rows(processor)

    def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
        """Run the argmax-invariant processors, or the others, over ``logits``."""
        for position in self._positions[argmax_invariant]:
            processor = self.processors[position]
            if position in self._resync:
                continue  # its update_state raised: its rows failed, its state is unknown
            shape = logits.shape
            try:
                processed = processor.apply(logits)
                if not isinstance(processed, torch.Tensor) or processed.shape != shape:
                    raise RuntimeError(
                        f"apply returned {getattr(processed, 'shape', type(processed))}; it "
                        f"must return logits of shape {tuple(shape)}"
                    )
            except Exception as exc:
                self._fail_batch(processor, "apply", exc)
            else:
                logits = processed
            self._take_failed_rows(processor)
        return logits

    def take_failures(self) -> dict[int, str]:
        """Batch index -> message of each row a processor failed in this step's update
        and sampling (see the module's docstring); cleared by the next update."""
        return dict(self._failures)

    def _take_failed_rows(self, processor: LogitsProcessor) -> None:
        take = getattr(processor, "take_failed_rows", None)
        if take is not None:
            for index, message in take().items():
                self._failures.setdefault(index, message)

    def _fail_batch(self, processor: LogitsProcessor, method: str, exc: Exception) -> None:
        name = f"{type(processor).__qualname__}.{method}"
        logger.warning("logits processor %s failed; failing its batch", name, exc_info=exc)
        message = f"logits processor {name} raised {type(exc).__name__}: {exc}"
        for index in range(self._batch_size):
            self._failures.setdefault(index, message)

    def _diff(self, requests: Sequence[BatchRequest]) -> BatchUpdate | None:
        keys = [request.key for request in requests]
        if keys == self._order:
            return None
        if len(set(keys)) != len(keys):
            raise ValueError("a request has two rows; custom logits processors need one each")
        wanted = set(keys)
        index_of = {key: index for index, key in enumerate(self._order)}
        removed = [index for key, index in index_of.items() if key not in wanted]
        occupant = {index: key for key, index in index_of.items() if key in wanted}
        index_of = {key: index for index, key in occupant.items()}
        added = []
        free = (index for index in itertools.count() if index not in occupant)
        for request in requests:
            if request.key not in index_of:
                index = next(free)
                occupant[index] = request.key
                index_of[request.key] = index
                added.append(
                    (index, request.params, request.prompt_token_ids, request.output_token_ids)
                )
        moved = []
        for target, key in enumerate(keys):
            source = index_of[key]
            if source == target:
                continue
            other = occupant.pop(target, None)
            del occupant[source]
            if other is None:
                moved.append((source, target, MoveDirectionality.UNIDIRECTIONAL))
            else:
                moved.append((source, target, MoveDirectionality.SWAP))
                occupant[source] = other
                index_of[other] = source
            occupant[target] = key
            index_of[key] = target
        self._order = keys
        return BatchUpdate(len(keys), removed, added, moved)


def _afresh(requests: Sequence[BatchRequest], held: int) -> BatchUpdate:
    """Indices ``0 .. held - 1`` removed, then the batch added at its rows."""
    added = [
        (index, request.params, request.prompt_token_ids, request.output_token_ids)
        for index, request in enumerate(requests)
    ]
    return BatchUpdate(len(requests), list(range(held)), added, [])
