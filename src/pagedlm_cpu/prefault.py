"""The CPU KV cache's pages faulted in ahead of use, on a thread that runs only when a core
is idle.

The KV cache is an anonymous mapping (``CpuPlatform.zeros``): the OS zeroes a page when it
is first written, so a multi-GiB cache costs nothing until used. But the block pool hands
out never-used blocks first, so until the whole cache has been used once, every step's new
K/V land in fresh pages, and each 4 KiB page costs a fault inside the step. On a Zen 5 VM
that is ~0.45 s of system time in a 7.5 s SmolLM2 run of 32 new prompts (42,000 faults,
one per page of the run's K/V), every run, until 4 GiB have been written.

``Prefaulter`` keeps each cache's pages written ahead of the pool: ``advance(addresses,
fraction)`` says how far into the caches at those addresses the step's writes reach (the
block dimension comes first, ``AttentionBackend.kv_cache_shape``, so a fraction of the
blocks is the same fraction of each tensor's bytes; each engine's attention backend names
its own caches, so one engine's progress never faults in another's), and a daemon thread at ``SCHED_IDLE`` priority asks the kernel to
fault in the pages up to ``LOOKAHEAD`` of each cache past it (``madvise``'s
``MADV_POPULATE_WRITE``, Linux 5.14+; elsewhere nothing happens and pages fault as
before). Populated pages are the zero pages a first write would have made, so nothing a
step reads changes. The thread never holds the interpreter while the kernel works
(``ctypes`` releases it), never keeps a cache alive (it holds each mapping weakly, and
strongly only for one chunk), and a cache that is never used takes no more memory than
the lookahead.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import math
import mmap
import os
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23
"""``<linux/mman.h>``: fault in the range as if written, without writing (Linux 5.14)."""

LOOKAHEAD = 1 / 16
"""How far past the step's writes each cache is kept faulted in, as a fraction of it:
256 MiB of a 4 GiB cache, what ~700 decode steps of 32 SmolLM2 requests write."""

CHUNK_BYTES = 2 << 20
"""Bytes per ``madvise`` call: the thread gives up each mapping between calls, and the
caches fill in block order, all of them side by side."""


@dataclass
class _Region:
    mapping: weakref.ref[mmap.mmap]
    address: int
    nbytes: int
    done: int = 0
    """Bytes from the start already faulted in."""
    fraction: float = 0.0
    """How far into it the writes have reached (``advance``)."""


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not hasattr(os, "sched_setscheduler") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


class Prefaulter:
    """Faults in registered mappings ahead of ``advance``'s fraction (module doc)."""

    def __init__(self) -> None:
        self._madvise = _madvise()
        self._regions: dict[int, _Region] = {}
        """By address."""
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def supported(self) -> bool:
        return self._madvise is not None

    def register(self, mapping: mmap.mmap, address: int, nbytes: int) -> None:
        """Keep ``nbytes`` of ``mapping`` (starting at ``address``, page-aligned) faulted
        in ahead of use, starting with its first ``LOOKAHEAD``."""
        if self._madvise is None or nbytes <= 0:
            return
        with self._lock:
            self._regions[address] = _Region(weakref.ref(mapping), address, nbytes)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="pagedlm-kv-prefault", daemon=True
                )
                self._thread.start()
        self._wake.set()

    def advance(self, addresses: Iterable[int], fraction: float) -> None:
        """The step's writes reach ``fraction`` (0-1) of the caches that start at
        ``addresses`` (others, and addresses of no registered cache, are left alone)."""
        regions = self._regions
        moved = False
        for address in addresses:
            region = regions.get(address)
            if region is not None and fraction > region.fraction:
                region.fraction = fraction
                moved = True
        if moved:
            self._wake.set()

    @staticmethod
    def _target(region: _Region) -> int:
        end = math.ceil(min(1.0, region.fraction + LOOKAHEAD) * region.nbytes)
        return min(region.nbytes, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE)

    def _next_chunk(self) -> tuple[mmap.mmap, _Region, int] | None:
        """The region furthest behind its target, alive (strongly held), and its chunk."""
        with self._lock:
            for address in [a for a, r in self._regions.items() if r.mapping() is None]:
                del self._regions[address]
            behind = [r for r in self._regions.values() if r.done < self._target(r)]
            if not behind:
                return None
            region = min(behind, key=lambda r: r.done / r.nbytes)
            mapping = region.mapping()
            if mapping is None:
                return None
            return mapping, region, min(CHUNK_BYTES, self._target(region) - region.done)

    def _run(self) -> None:
        # Where that is not allowed, the thread still faults in only what is ahead.
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        assert self._madvise is not None
        while True:
            self._wake.wait()
            self._wake.clear()
            while (chunk := self._next_chunk()) is not None:
                mapping, region, size = chunk
                if self._madvise(region.address + region.done, size, MADV_POPULATE_WRITE):
                    error = ctypes.get_errno()
                    logger.debug("KV cache prefault off: madvise failed (%s)", os.strerror(error))
                    self._madvise = None
                    return
                region.done += size
                del mapping, chunk


PREFAULTER = Prefaulter()
"""The process's one prefaulter: every CPU KV cache registers with it."""


def _reset_in_child() -> None:
    # A forked child has none of the parent's threads (the lock may be held by one), and
    # its caches are its own.
    PREFAULTER.__init__()  # type: ignore[misc]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
