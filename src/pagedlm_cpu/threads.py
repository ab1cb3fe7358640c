"""CPU threads: every core the process is given computes GEMMs, in one thread pool.

torch's intra-op pool (OpenMP in the official builds) runs every parallel kernel: oneDNN
and MKL matmuls, the int4 kernel, SDPA, elementwise ops. oneDNN and MKL are built to use
that same OpenMP runtime, so there is one pool as long as one OpenMP runtime is loaded; a
second one (Intel's libiomp5 or LLVM's libomp next to GNU's libgomp, e.g. from another
native extension) brings a second pool whose threads compete for the same cores.

The default pool size is torch's (physical cores), which can exceed the cores the process
may run on (``taskset``, container CPU sets): then threads time-share a core and every
parallel region waits for the slowest. ``configure_threads`` sizes the pool to the cores
given, unless the user fixed it with ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_OPENMP_LIBRARY = re.compile(r"lib(gomp|iomp5|omp)[-.\w]*\.so")


@dataclass(frozen=True)
class ThreadReport:
    cores_given: int
    """CPUs in this process's affinity mask."""
    torch_threads: int
    """Size of torch's intra-op pool after configuration (GEMMs, attention, elementwise)."""
    set_by_user: bool
    """OMP_NUM_THREADS was set, so the pool size is the user's."""
    openmp_runtimes: tuple[str, ...]
    """OpenMP runtimes loaded in the process (more than one means competing pools)."""

    def describe(self) -> str:
        source = "OMP_NUM_THREADS" if self.set_by_user else "the cores given"
        runtimes = ", ".join(self.openmp_runtimes) or "none found"
        return (
            f"{self.torch_threads} torch threads ({source}; {self.cores_given} cores given), "
            f"OpenMP runtimes: {runtimes}"
        )


def cores_given() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def loaded_openmp_runtimes() -> tuple[str, ...]:
    """Distinct OpenMP runtime libraries mapped into this process (Linux; () elsewhere)."""
    try:
        with open("/proc/self/maps") as maps:
            found = {m.group(1) for line in maps if (m := _OPENMP_LIBRARY.search(line))}
    except OSError:
        return ()
    return tuple(sorted(found))


def configure_threads() -> ThreadReport:
    """Size torch's pool to the cores given (unless OMP_NUM_THREADS says otherwise) and
    report the pools; warns when several OpenMP runtimes are loaded."""
    cores = cores_given()
    set_by_user = "OMP_NUM_THREADS" in os.environ
    if not set_by_user and torch.get_num_threads() != cores:
        torch.set_num_threads(cores)
    report = ThreadReport(cores, torch.get_num_threads(), set_by_user, loaded_openmp_runtimes())
    if len(report.openmp_runtimes) > 1:
        logger.warning(
            "Several OpenMP runtimes are loaded (%s): their thread pools compete for the same "
            "cores. Import the library that brings the extra one after torch, or set "
            "OMP_NUM_THREADS to split the cores between them.",
            ", ".join(report.openmp_runtimes),
        )
    return report
