"""Python's cyclic garbage collector kept off the objects that start-up leaves behind.

After start-up an engine's process holds a few hundred thousand long-lived objects: torch's
and transformers' modules, the model's parameters and modules, the tokenizer, captured
graphs. Every generation-2 collection walks all of them, and serving triggers such
collections regularly, because each step allocates per-request objects (outputs, token
lists, messages) that survive a young collection or two. Measured with
``python -m pagedlm.benchmarks.host_overhead --clock cpu`` (256 requests decoding a
negligible model, the engine's host work per step, on a 2-core machine): 13.4 ms per step,
of which the collector took 3.7 ms (gen-2 passes of ~200 ms each); 7.6 ms with the heap
frozen, the collector then 0.07 ms. On the H200 host: 4.15 ms per step against 3.03
frozen (docs/performance.md, session 10).

``freeze_startup_heap`` collects once and then moves everything alive into the permanent
generation (``gc.freeze``), which later collections skip. Frozen objects are still freed
by reference counting as usual; only reference cycles among them are never collected,
which bounds what can leak by the start-up heap, once. It is called where a process has
finished starting: the offline engine, the engine-core process, the front end and each
worker process. ``PAGEDLM_GC_FREEZE=0`` leaves the collector as Python sets it.

A process may build several engines one after the other (a notebook, a test session): a
discarded engine's cycles were frozen with it, so ``thaw_heap`` (at an engine's shutdown and
before the next one starts) unfreezes and collects them, and ``collect_garbage`` (sleep
mode's release of device memory) collects frozen garbage too and refreezes.
"""

from __future__ import annotations

import gc
import logging
import os
import time

logger = logging.getLogger(__name__)

FREEZE_ENV = "PAGEDLM_GC_FREEZE"


def freeze_startup_heap(where: str) -> int:
    """Collect, then freeze every live object; returns how many are frozen in all (0 when
    ``PAGEDLM_GC_FREEZE=0``). Safe to call more than once: each call adds what was
    allocated since the previous one."""
    if os.environ.get(FREEZE_ENV, "1") == "0":
        return 0
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug(
        "%s: %d objects frozen out of the garbage collector's passes (%.0f ms)",
        where,
        frozen,
        1e3 * (time.perf_counter() - start),
    )
    return frozen


def thaw_heap() -> None:
    """Make the frozen objects collectable again and collect (a no-op when none are
    frozen): what a discarded engine left in cycles is freed before the next one allocates."""
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()


def collect_garbage() -> None:
    """``gc.collect()`` over frozen objects too; they are frozen again afterwards."""
    frozen = gc.get_freeze_count()
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()
