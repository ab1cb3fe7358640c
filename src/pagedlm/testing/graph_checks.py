"""Checks of an attention backend's graph hooks and padding rows (only for the query
lengths its ``supports_graph`` accepts: padding rows appear only in replayed steps).

The kit plays the model runner and its graph runner: it keeps static step buffers (query
offsets, lengths, block tables, slot mapping, and the q/k/v inputs) of a captured size,
builds the capture's metadata over them with ``build_graph_metadata`` while they hold
padding rows only, then refills them in place for real steps (the real rows, then padding
rows up to the captured size), calls ``prepare_graph_replay`` and replays. On a CUDA
device the forward is captured in a real ``torch.cuda.CUDAGraph``; elsewhere "replay"
calls ``forward`` again with the capture's metadata, which is all a graph could see.

Every replay is compared with the reference (promise ``graph_metadata``), and its KV cache
with the cache an eager run of the same step (no padding) leaves (``padding_rows``).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedlm.attention import BatchLayout
from pagedlm.testing.paged_steps import PagedSteps, RowsOfStep
from pagedlm.testing.promises import ConformanceFailure, NotApplicable
from pagedlm.testing.target import AttentionTarget

GRAPH_QUERY_LENS = (1, 2)
"""Decode steps, and steps verifying one speculative token."""
NUM_PADDING_ROWS = 2


def graph_query_lens(target: AttentionTarget) -> tuple[int, ...]:
    backend = target.new_backend()
    return tuple(q for q in GRAPH_QUERY_LENS if backend.supports_graph(q))


class StaticStep:
    """Persistent step buffers of ``num_rows`` requests of ``query_len`` tokens each."""

    def __init__(self, steps: PagedSteps, num_rows: int, query_len: int, max_model_len: int):
        device, dtype = steps.target.device, steps.target.dtype
        num_heads, num_kv_heads, head_dim = steps.shape
        self.steps = steps
        self.num_rows, self.query_len, self.max_model_len = num_rows, query_len, max_model_len
        num_tokens = num_rows * query_len
        width = -(-max_model_len // steps.block_size)

        def buffer(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.query_start_loc = buffer(num_rows + 1)
        self.seq_lens = buffer(num_rows)
        self.block_table = buffer(num_rows, width)
        self.slot_mapping = buffer(num_tokens)
        self.query = buffer(num_tokens, num_heads, head_dim, dtype=dtype)
        self.key = buffer(num_tokens, num_kv_heads, head_dim, dtype=dtype)
        self.value = buffer(num_tokens, num_kv_heads, head_dim, dtype=dtype)

    def fill(self, rows: RowsOfStep | None) -> BatchLayout:
        """Write ``rows`` (None: none), then padding rows, into the buffers in place: one
        padding row per missing request, ``query_len`` tokens at slot -1, seq_len 0, block
        table row 0; its q/k/v are random, so that writing or reading them shows."""
        num_real = len(rows.plan) if rows else 0
        num_padding = self.num_rows - num_real
        real_tokens = rows.query_start_loc[-1] if rows else 0
        qsl = (rows.query_start_loc if rows else [0]) + [
            real_tokens + self.query_len * (i + 1) for i in range(num_padding)
        ]
        seq_lens = (rows.seq_lens if rows else []) + [0] * num_padding
        tables = np.zeros(tuple(self.block_table.shape), dtype=np.int32)
        for i, table in enumerate(rows.block_tables if rows else []):
            tables[i, : len(table)] = table
        slots = (rows.slot_mapping if rows else []) + [-1] * (num_padding * self.query_len)
        self.query_start_loc.copy_(torch.tensor(qsl, dtype=torch.int32))
        self.seq_lens.copy_(torch.tensor(seq_lens, dtype=torch.int32))
        self.block_table.copy_(torch.from_numpy(tables))
        self.slot_mapping.copy_(torch.tensor(slots, dtype=torch.int32))
        for buffer, real in zip(
            (self.query, self.key, self.value),
            (rows.query, rows.key, rows.value) if rows else (None,) * 3,
        ):
            padding = self.steps.random_tensor((buffer.shape[0] - real_tokens, *buffer.shape[1:]))
            buffer.copy_(padding if real is None else torch.cat([real, padding]))
        return BatchLayout(
            num_reqs=self.num_rows,
            num_tokens=self.num_rows * self.query_len,
            max_query_len=self.query_len,
            max_seq_len=self.max_model_len,
            block_size=self.steps.block_size,
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_table=self.block_table,
            slot_mapping=self.slot_mapping,
            query_start_loc_cpu=np.asarray(qsl, dtype=np.int32),
            seq_lens_cpu=np.asarray(seq_lens, dtype=np.int32),
        )


def check_graph_replay(target: AttentionTarget) -> None:
    """Replays of captured uniform steps match the reference and write what an eager step
    writes; a capture-time forward over padding rows only writes nothing."""
    query_lens = graph_query_lens(target)
    if not query_lens:
        raise NotApplicable(
            f"{target.name} captures no graph (supports_graph is False for query lengths "
            f"{', '.join(map(str, GRAPH_QUERY_LENS))}), so it never sees padding rows"
        )
    for query_len in query_lens:
        for block_size in target.block_sizes:
            for seed, shape in enumerate(target.head_shapes):
                steps = PagedSteps(target, shape, block_size, seed=seed)
                _check_replays(steps, query_len)


def _check_replays(steps: PagedSteps, query_len: int) -> None:
    size = steps.block_size
    contexts = (size + 3, 2 * size - 1, 5)
    requests = [steps.add(n + 2 * query_len) for n in contexts]
    steps.step(list(zip(requests, contexts)), "causal_prefill")
    static = StaticStep(steps, len(requests) + NUM_PADDING_ROWS, query_len, 4 * size)
    where = f"a graph of {static.num_rows} rows x {query_len} tokens"
    metadata = steps.call(
        "graph_metadata",
        "build_graph_metadata",
        steps.backend.build_graph_metadata,
        static.fill(None),
    )
    before = _snapshot(steps)
    out = steps.forward(static.query, static.key, static.value, metadata, "padding_rows")
    _expect_caches(steps, before, f"the capture forward of {where}, all padding rows")
    graph = None
    if steps.target.device.type == "cuda":
        graph, out = _capture(steps, static, metadata)
    # All requests, then fewer (more padding): the second replay sees different values in
    # every buffer, so metadata that kept capture-time values cannot match both.
    for plan in (
        [(r, query_len) for r in requests],
        [(requests[2], query_len), (requests[0], query_len)],
    ):
        rows = steps.rows(plan)
        expected_caches = _eager_caches(steps, rows)
        layout = static.fill(rows)
        steps.call(
            "graph_metadata",
            "prepare_graph_replay",
            steps.backend.prepare_graph_replay,
            metadata,
            layout,
        )
        if graph is not None:
            graph.replay()
        else:
            out = steps.forward(static.query, static.key, static.value, metadata, "graph_metadata")
        steps.check(rows, out[: rows.query_start_loc[-1]], "graph_metadata")
        num_padding = static.num_rows - len(plan)
        _expect_caches(steps, expected_caches, f"replaying {where} with {num_padding} padding rows")
        steps.advance(plan)


def _capture(
    steps: PagedSteps, static: StaticStep, metadata: object
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = steps.forward(static.query, static.key, static.value, metadata, "graph_metadata")
    return graph, out


def _snapshot(steps: PagedSteps) -> tuple[torch.Tensor, torch.Tensor]:
    return steps.key_cache.clone(), steps.value_cache.clone()


def _expect_caches(
    steps: PagedSteps, expected: tuple[torch.Tensor, torch.Tensor], what: str
) -> None:
    """The caches equal ``expected`` (what an eager step without padding leaves)."""
    if not (
        torch.equal(steps.key_cache, expected[0]) and torch.equal(steps.value_cache, expected[1])
    ):
        raise ConformanceFailure(
            steps.target.name,
            "padding_rows",
            f"{steps.describe()}: {what} left the KV cache different from the same step "
            "without padding",
        )


def _eager_caches(steps: PagedSteps, rows: RowsOfStep) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches after the step ``rows`` runs eagerly (no padding) on a fresh backend."""
    key_cache, value_cache = _snapshot(steps)
    backend = steps.target.new_backend()
    metadata = steps.call(
        "padding_rows", "build_metadata", backend.build_metadata, steps.layout(rows)
    )
    steps.call(
        "padding_rows",
        "forward",
        backend.forward,
        *steps.on_device(rows),
        key_cache,
        value_cache,
        metadata,
        steps.scale,
    )
    return key_cache, value_cache
