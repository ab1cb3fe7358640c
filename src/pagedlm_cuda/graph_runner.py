"""CUDA graphs for decode steps, captured at start-up at a ladder of padded batch sizes.

A decode step launches a few hundred small kernels; replaying them as one graph removes
the per-launch CPU cost, which dominates at small batches. Everything a captured step
reads lives in static device buffers: one packed int32 buffer holds input ids, positions
and the attention metadata, refilled each step by a single pinned, asynchronous copy.
Multi-step decoding replays several steps back to back without waiting for the host: a
step's input ids may be a device tensor (the previous step's sampled tokens), and the
pinned host buffers form a ring guarded by events, so the host can fill the next step's
metadata while the device still copies an earlier one.
A batch of ``n`` requests runs in the smallest captured size ``>= n``; the padding rows
write no K/V (slot -1) and attend to nothing (seq_len 0). The decode attention split
depends on the batch only through its capture-size bucket (``kernels/decode_config.py``)
and its grid is sized by ``max_model_len``, so a request's result does not depend on the
padding or on whether the step ran from a graph.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.platforms.interface import DecodeGraphRunner
from pagedlm_cuda.attention import (
    SECTION_ALIGN,
    TritonAttentionBackend,
    TritonMetadata,
    pack_layout,
    section_offsets,
    unpack,
)

logger = logging.getLogger(__name__)

HOST_RING_SIZE = 8
"""Pinned host buffers in flight: how many steps the host may fill ahead of the device
(a chained multi-step window is queued while the previous one still runs)."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 (16 above 256) up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    size = 8
    while size <= max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CudaGraphRunner(DecodeGraphRunner):
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: object,
        device: torch.device,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        attn_backend: TritonAttentionBackend,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)
        self.sizes = capture_sizes(max_num_seqs)
        self.attn_backend = attn_backend
        largest = self.sizes[-1]
        # [input_ids | positions | packed layout] for the largest batch; smaller sizes use
        # prefixes of each section, so every section is laid out for ``largest`` rows
        # (and starts aligned, as in ``section_offsets``).
        self._rows = -(-largest // SECTION_ALIGN) * SECTION_ALIGN
        self._sections = section_offsets(largest, largest, self.width)
        length = 2 * self._rows + self._sections[-1]
        self._ring = [
            (torch.zeros(length, dtype=torch.int32).pin_memory(), torch.cuda.Event())
            for _ in range(HOST_RING_SIZE)
        ]
        self._next = 0
        self._device = torch.zeros(length, dtype=torch.int32, device=device)
        self._largest = largest
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @classmethod
    def for_model_runner(cls, runner) -> CudaGraphRunner | None:
        """A captured runner for ``pagedlm.worker.model_runner.ModelRunner``, or None when
        its attention backend is not the Triton one."""
        if not isinstance(runner.attn_backend, TritonAttentionBackend):
            logger.info("CUDA graphs off: attention backend %s", runner.attn_backend.name)
            return None
        sched = runner.config.scheduler
        graphs = cls(
            runner.model,
            runner.kv_cache,
            runner.device,
            sched.max_num_seqs,
            sched.max_model_len,
            runner.block_size,
            runner.attn_backend,
        )
        graphs.capture()
        return graphs

    def _views(self, num_reqs: int) -> tuple[torch.Tensor, torch.Tensor, TritonMetadata]:
        buf = self._device
        input_ids = buf[:num_reqs]
        positions = buf[self._rows : self._rows + num_reqs]
        layout = buf[2 * self._rows :]
        qsl_at, lens_at, tables_at, _ = self._sections
        tables = layout[tables_at : tables_at + num_reqs * self.width].view(num_reqs, self.width)
        metadata = TritonMetadata(
            slot_mapping=layout[:num_reqs],
            query_start_loc=layout[qsl_at : qsl_at + num_reqs + 1],
            seq_lens=layout[lens_at : lens_at + num_reqs],
            block_tables=tables,
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        return input_ids, positions, metadata

    def _fill(
        self,
        input_ids: list[int] | torch.Tensor,
        positions: list[int],
        layout: BatchLayout,
        size: int,
    ) -> None:
        """Write one step into the next pinned ring buffer (padded to ``size`` rows) and
        copy it to the static device buffer; device ``input_ids`` are copied on the device."""
        rows = self._rows
        pinned, copied = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        copied.synchronize()  # the device has finished reading this buffer's last contents
        host = pinned.numpy()
        n = len(positions)
        if isinstance(input_ids, torch.Tensor):
            host[:size] = 0
        else:
            host[:n] = input_ids
            host[n:size] = 0
        host[rows : rows + n] = positions
        host[rows + n : rows + size] = 0
        packed = pack_layout(layout, size, self.width)
        slots, qsl, lens, tables = unpack(torch.from_numpy(packed), size, size, self.width)
        base = 2 * rows
        qsl_at, lens_at, tables_at, _ = self._sections
        host[base : base + size] = slots.numpy()
        host[base + qsl_at : base + qsl_at + size + 1] = qsl.numpy()
        host[base + lens_at : base + lens_at + size] = lens.numpy()
        host[base + tables_at : base + tables_at + size * self.width] = tables.numpy().reshape(-1)
        # One transfer, up to the end of this size's block tables: everything the step
        # reads lies before it (at batch 1 a few KB instead of the whole few hundred).
        end = base + tables_at + size * self.width
        self._device[:end].copy_(pinned[:end], non_blocking=True)
        copied.record()
        if isinstance(input_ids, torch.Tensor):
            self._device[:n].copy_(input_ids, non_blocking=True)

    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        empty = BatchLayout([0], [], [], [], 1)
        for size in reversed(self.sizes):
            self._fill([], [], empty, size)
            input_ids, positions, metadata = self._views(size)
            ctx = ForwardContext(self.attn_backend, metadata, self.kv_cache)
            with torch.inference_mode():
                self.model(input_ids, positions, ctx)  # compiles kernels, warms allocators
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self.model(input_ids, positions, ctx)
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()
        logger.info(
            "Captured decode CUDA graphs for %d batch sizes (1..%d) in %.1f s",
            len(self.sizes),
            self._largest,
            time.perf_counter() - start,
        )

    def can_run(self, layout: BatchLayout) -> bool:
        if layout.num_reqs == 0 or layout.num_reqs > self._largest:
            return False
        if layout.num_tokens != layout.num_reqs:
            return False
        return max(layout.seq_lens) <= self.max_model_len

    def run(
        self, input_ids: list[int] | torch.Tensor, positions: list[int], layout: BatchLayout
    ) -> torch.Tensor:
        num_reqs = layout.num_reqs
        size = self.sizes[int(np.searchsorted(self.sizes, num_reqs))]
        self._fill(input_ids, positions, layout, size)
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden[:num_reqs]
