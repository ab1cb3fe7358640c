"""A worker's custom logits processors and the batch they were last told about.

``update(requests)`` diffs a step's sampled requests (in logits-row order) against the
last batch into one ``BatchUpdate`` that keeps the interface's promises: removals first,
additions only at free indices (the lowest ones), then moves (to a free index, or swaps)
that put every request at its row. Each request stays at its index while the order holds,
so a decode batch costs one list comparison per step.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedlm.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)
from pagedlm.sampling_params import SamplingParams


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
        self.argmax_invariant = tuple(p for p in processors if p.is_argmax_invariant())
        self.others = tuple(p for p in processors if not p.is_argmax_invariant())
        self._order: list[int] = []
        """The keys of the last batch, by index."""

    def update(self, requests: Sequence[BatchRequest]) -> None:
        """Tell every processor the batch of a step about to be sampled."""
        batch_update = self._diff(requests)
        for processor in self.processors:
            processor.update_state(batch_update)

    def apply(self, logits: torch.Tensor, argmax_invariant: bool) -> torch.Tensor:
        """Run the argmax-invariant processors, or the others, over ``logits``."""
        for processor in self.argmax_invariant if argmax_invariant else self.others:
            shape = logits.shape
            logits = processor.apply(logits)
            if not isinstance(logits, torch.Tensor) or logits.shape != shape:
                raise RuntimeError(
                    f"logits processor {type(processor).__qualname__}.apply returned "
                    f"{getattr(logits, 'shape', type(logits))}; it must return logits of "
                    f"shape {tuple(shape)}."
                )
        return logits

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
