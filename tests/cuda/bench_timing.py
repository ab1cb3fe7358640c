"""CUDA-graph timing for the GEMV bench (run as a script, so imported from this folder)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_us(calls: list[Callable[[], object]]) -> tuple[float, list[object]]:
    """Microseconds per call, the median of 5 replays of one CUDA graph of ``calls``, and
    what the calls returned (their outputs hold the last replay's values). The first two
    calls run eagerly first, so compiles and workspace growth stay outside the capture."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    outs: list[object] = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            outs.append(call())
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return sorted(times)[2], outs
