"""What the shared-storage connector's scheduler side knows about the files in its
directory (``shared_storage.py``): which blocks are stored, and which it has asked the
workers to write.

Invariants: a block counts as stored only once a file for it was seen on disk or its write
was reported done; a block whose write is in flight is planned by no other step; a step
whose writes are reported with a failure leaves its blocks to be looked up on disk again,
so those that were not written are planned again by a later step; an invalidated block is
removed from disk, once its write is reported if that is still in flight. Memory is bounded: at
most ``max_remembered`` stored blocks are remembered (least recently used forgotten, and
looked up on disk again when asked about).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable

MAX_REMEMBERED_BLOCKS = 1 << 16
"""Stored block digests the scheduler side remembers (about 10 MiB of Python strings)."""


class StoredBlocks:
    """Stored and in-flight blocks by digest (module doc). ``exists(key)``: whether a file
    for ``key`` is on disk now; ``remove(key)``: delete it (none: nothing to do)."""

    def __init__(
        self,
        exists: Callable[[str], bool],
        remove: Callable[[str], None],
        max_remembered: int = MAX_REMEMBERED_BLOCKS,
    ) -> None:
        assert max_remembered > 0
        self._exists = exists
        self._remove = remove
        self.max_remembered = max_remembered
        self._stored: OrderedDict[str, None] = OrderedDict()
        self._saving: set[str] = set()
        self._saves_in_flight: deque[list[str]] = deque()
        """Per step with saves, in step order: the digests it writes."""
        self._step: list[str] = []
        """The saves of the step being planned."""
        self._doomed: set[str] = set()
        """Invalidated while their write was in flight: removed once it is reported."""

    def __len__(self) -> int:
        return len(self._stored)

    def is_stored(self, key: str) -> bool:
        if key in self._stored:
            self._stored.move_to_end(key)
            return True
        if self._exists(key):
            self._remember(key)
            return True
        return False

    def plan_save(self, key: str) -> bool:
        """Whether the step being planned should write ``key`` (neither stored nor being
        written); if so, it now counts as being written."""
        if key in self._saving or self.is_stored(key):
            return False
        self._saving.add(key)
        self._step.append(key)
        return True

    def end_step(self) -> None:
        """The step being planned is complete (its saves are reported by ``saved``)."""
        if self._step:
            self._saves_in_flight.append(self._step)
            self._step = []

    def saved(self, num_failed: int) -> None:
        """The oldest step with saves reported, ``num_failed`` of its writes failing."""
        keys = self._saves_in_flight.popleft()
        self._saving.difference_update(keys)
        doomed = self._doomed.intersection(keys)
        if doomed:
            self._doomed -= doomed
            for key in doomed:
                self._remove(key)
            keys = [key for key in keys if key not in doomed]
        if not num_failed:
            for key in keys:
                self._remember(key)
        # Else which ones failed is not reported: each is looked up on disk when next asked.

    def invalidate(self, keys: list[str]) -> None:
        """Blocks whose stored keys and values cannot be trusted: remove them from disk now,
        or once their write in flight is reported."""
        for key in keys:
            self._stored.pop(key, None)
            if key in self._saving:
                self._doomed.add(key)
            else:
                self._remove(key)

    def forget(self, keys: Iterable[str] | None = None) -> None:
        """Forget the stored blocks (``keys``, or all: files may have been removed; they
        are looked up on disk when next asked); writes in flight stay."""
        if keys is None:
            self._stored.clear()
            return
        for key in keys:
            self._stored.pop(key, None)

    def _remember(self, key: str) -> None:
        self._stored[key] = None
        self._stored.move_to_end(key)
        if len(self._stored) > self.max_remembered:
            self._stored.popitem(last=False)
