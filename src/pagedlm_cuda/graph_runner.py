"""CUDA graphs of uniform steps, captured at start-up at a ladder of padded batch sizes.

A decode step launches a few hundred small kernels; replaying them as one graph removes
the per-launch CPU cost, which dominates at small batches. A graph is keyed by (requests,
tokens per request): every request of a step it replays feeds the same number of tokens
(1 for decode; 1 + k for speculative verification, where the backend captures it).

Everything a captured step reads lives in the model runner's persistent step buffers
(``pagedlm.worker.step_inputs``): the runner copies the step's layout and gather indices
there for the padded batch, then ``run`` replays the gathers (input ids, slot mapping, block
tables from the input batch's tables) and the forward. Which query lengths can be captured, and the metadata a capture holds,
are the attention backend's to say (``supports_graph``, ``build_graph_metadata``,
``prepare_graph_replay``); this module knows no backend. A batch of ``n`` requests runs in
the smallest captured size ``>= n``; padding rows write no K/V (slot -1) and attend to
nothing (seq_len 0). The Triton decode kernel's split depends on the batch only through
its capture-size bucket (``kernels/decode_config.py``) and its grid is sized by
``max_model_len``, so a request's result does not depend on the padding or on whether
the step ran from a graph.

A model with a module known not to be capturable (its ``uncapturable`` says why: MoE
layers that group tokens by expert on the host, gpt-oss's and any ``FusedMoE`` the
platform gave no grouped GEMM: float32 experts, or all of them with
``PAGEDLM_FUSED_MOE=0``) gets no graphs: every step runs eagerly,
logged once at start-up. A model whose forward may not be capturable (``capture_may_fail``:
the Transformers backend, whose forward may wait for the device, as ``.item()`` does)
fails its first capture and then runs eagerly likewise. Any other model's failed capture
is an error.

Which graphs and sizes are captured is the engine's ``CompilationConfig`` (vLLM's
``cudagraph_mode``, ``cudagraph_capture_sizes``, ``max_cudagraph_capture_size``): whole
steps at the ladder's sizes (or the configured ones) unless the mode has no full graphs,
pieces (``piecewise_graphs``) unless it has no piecewise ones.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from pagedlm.attention.backend import AttentionBackend, BatchLayout
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.platforms.interface import GraphRunner
from pagedlm_cuda.batch_sizes import capture_sizes
from pagedlm_cuda.piecewise_graphs import PiecewiseGraphs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Captured:
    graph: Any
    """A ``torch.cuda.CUDAGraph`` (anything with ``replay()``)."""
    hidden: torch.Tensor
    metadata: Any


class CudaGraphRunner(GraphRunner):
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: object,
        attn_backend: AttentionBackend,
        step_inputs: Any,
        sizes: list[int],
        query_lens: tuple[int, ...],
        max_model_len: int,
    ) -> None:
        """``step_inputs``: the model runner's ``StepInputBuilder`` (its buffers are the
        graphs' inputs)."""
        self.model = model
        self.kv_cache = kv_cache
        self.attn_backend = attn_backend
        self.step_inputs = step_inputs
        self.sizes = sizes
        self.query_lens = query_lens
        self.max_model_len = max_model_len
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self.pool: Any = None
        self.pieces: PiecewiseGraphs | None = None
        """Steps no uniform graph serves (``run_mixed``), captured into the same pool."""

    @classmethod
    def for_model_runner(cls, runner: Any) -> CudaGraphRunner | None:
        """Graphs for ``pagedlm.worker.model_runner.ModelRunner``, or None when its
        attention backend captures no step shape."""
        backend = runner.attn_backend
        wanted = [1]
        speculative = getattr(runner.config, "speculative", None)
        if speculative is not None:  # verification steps: 1 + k tokens per request
            wanted.append(1 + speculative.num_speculative_tokens)
        query_lens = tuple(q for q in wanted if backend.supports_graph(q))
        if not query_lens:
            logger.info("CUDA graphs off: attention backend %s captures no step", backend.name)
            return None
        blocker = next(
            (m.uncapturable for m in runner.model.modules() if getattr(m, "uncapturable", None)),
            None,
        )
        if blocker is not None:
            logger.info("CUDA graphs off: %s; steps run eagerly", blocker)
            return None
        compilation = runner.config.compilation  # which graphs, at which sizes
        sched = runner.config.scheduler
        largest = min(sched.max_num_seqs, sched.max_num_batched_tokens // max(query_lens))
        sizes = compilation.sizes(capture_sizes(largest)) if compilation.full_graphs else []
        graphs = cls(
            runner.model,
            runner.kv_cache,
            backend,
            runner.step_inputs,
            sizes,
            query_lens if sizes else (),
            sched.max_model_len,
        )
        try:
            graphs.capture()
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            # A forward pagedlm did not write (the Transformers backend) may sync with the
            # host or branch on device values; then every step runs eagerly, as it must.
            # pagedlm's own models are written to be captured: their failures are bugs.
            if not getattr(runner.model, "capture_may_fail", False):
                raise
            logger.warning(
                "CUDA graphs off (the forward cannot be captured; steps run eagerly, "
                "enforce_eager=True skips the attempt): %s",
                error,
            )
            return None
        if compilation.piecewise_graphs:
            graphs.pieces = graphs._capture_pieces(runner)
        return graphs if graphs.sizes or graphs.pieces is not None else None

    def capture(self) -> None:
        start = time.perf_counter()
        pool = self.pool = self._new_pool()  # the pieces' too
        if not self.sizes:
            return
        for query_len in self.query_lens:
            for size in reversed(self.sizes):
                self._graphs[size, query_len] = self._capture_one(size, query_len, pool)
        self._synchronize()
        logger.info(
            "Captured CUDA graphs for %d batch sizes (1..%d) x query lengths %s in %.1f s",
            len(self.sizes),
            self.sizes[-1],
            list(self.query_lens),
            time.perf_counter() - start,
        )

    def _capture_one(self, size: int, query_len: int, pool: Any) -> _Captured:
        inputs = self.step_inputs.capture_inputs(size, query_len)
        layout = replace(inputs.layout, max_query_len=query_len, max_seq_len=self.max_model_len)
        metadata = self.attn_backend.build_graph_metadata(layout)
        ctx = ForwardContext(self.attn_backend, metadata, self.kv_cache)

        def step() -> torch.Tensor:
            # The step's gathers from the input batch's tables, then the forward.
            self.step_inputs.gather(inputs)
            return self.model(inputs.input_ids, inputs.positions, ctx)

        with torch.inference_mode():
            graph, hidden = self._record(step, pool)
        return _Captured(graph, hidden, metadata)

    # The three device-specific parts, overridable where graphs are emulated (the CPU
    # tests replay a "graph" by calling its step again over the same buffers).
    def _new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def _synchronize(self) -> None:
        torch.cuda.synchronize()

    def _capture_pieces(self, runner: Any) -> PiecewiseGraphs | None:
        return PiecewiseGraphs.for_model_runner(runner, self.pool)

    def _record(self, step: Callable[[], torch.Tensor], pool: Any) -> tuple[Any, torch.Tensor]:
        """(something with ``replay()`` that reruns ``step``, the tensor it writes into)."""
        step()  # compiles, warms allocators
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            hidden = step()
        return graph, hidden

    def padded_num_reqs(self, num_reqs: int, query_len: int) -> int | None:
        if query_len not in self.query_lens or not self.sizes or num_reqs > self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_reqs)]

    def run_mixed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        return None if self.pieces is None else self.pieces.run(input_ids, ctx)

    def run(self, layout: BatchLayout) -> torch.Tensor:
        captured = self._graphs[layout.num_reqs, layout.num_tokens // layout.num_reqs]
        self.attn_backend.prepare_graph_replay(captured.metadata, layout)
        captured.graph.replay()
        return captured.hidden
