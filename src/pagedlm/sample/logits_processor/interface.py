"""Custom logits processors: the batch-level interface (vLLM v1's, under pagedlm's names).

A processor is constructed once per worker and sees every step's logits ``[N, vocab]``
(float32, one row per sampled request). Between steps it is told how the batch changed:

- ``update_state(batch_update)`` runs before every ``apply`` of a step with rows to sample;
  ``batch_update`` is None when the batch is the one of the last call. Apply its parts in
  this order: ``removed``, then ``added``, then ``moved``.
- ``added`` entries are ``(index, params, prompt_token_ids, output_token_ids)``; the output
  list is the request's own, extended in place as it generates, so a processor may keep a
  reference and read it at every ``apply`` (it holds every token sampled before this step).
- An added index is free when it is added (removals and moves never leave it occupied);
  a ``moved`` entry ``(a, b, UNIDIRECTIONAL)`` moves the request at ``a`` to the free index
  ``b``; ``(a, b, SWAP)`` exchanges two requests.
- A request that does not sample in a step (a prompt chunk before its last, a preemption)
  may be removed and added again later with the same lists.

Processors whose ``is_argmax_invariant()`` is True (they never change which token is
largest, e.g. a min-p style filter) are skipped for greedy batches and run after
temperature; the others run before the penalties, on every row (vLLM's order).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, TypeVar

import torch

from pagedlm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()
    """The request at the first index moves to the second, which was free; the first is
    free after."""
    SWAP = auto()
    """The requests at the two indices exchange places."""


RemovedRequest = int
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
"""``(index, params, prompt_token_ids, output_token_ids)``."""
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last ``update_state``; ``batch_size`` rows now."""

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Subclass, then name the class in ``LLM(logits_processors=[...])``,
    ``--logits-processors module:Class``, or the ``pagedlm.logits_processors`` entry-point
    group. Per-request settings travel in ``SamplingParams.extra_args`` (``vllm_xargs`` over
    HTTP)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` for parameters this processor cannot honour; it runs when a
        request arrives, so a bad request fails alone (a 400 over HTTP)."""
        return None

    @abstractmethod
    def __init__(self, config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        """``config``: the engine's; ``config.scheduler.max_num_seqs`` bounds the batch."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits``: ``[batch_size, vocab]`` float32, row ``i`` the request added at index
        ``i``. Return the processed logits (writing in place is allowed)."""

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if ``apply`` never changes a row's largest entry."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Take the batch's changes (see the module's docstring) before ``apply``."""


T = TypeVar("T")


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Keep ``req_entries`` (batch index -> a processor's per-request state) in step with
    ``batch_update``; ``new_state`` gives an added request's state, or None when the
    processor leaves it alone. Returns whether any entry changed."""
    if batch_update is None:
        return False
    changed = False
    for index in batch_update.removed:
        changed |= req_entries.pop(index, None) is not None
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        else:
            changed |= req_entries.pop(index, None) is not None
    for source, target, direction in batch_update.moved:
        moving = req_entries.pop(source, None)
        other = None
        if direction is MoveDirectionality.SWAP:
            other = req_entries.pop(target, None)
            if other is not None:
                req_entries[source] = other
        if moving is not None:
            req_entries[target] = moving
        changed |= moving is not None or other is not None
    return changed
