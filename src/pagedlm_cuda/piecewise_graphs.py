"""CUDA graphs of the forward between attention calls, for steps no uniform graph serves.

A step that mixes prefill chunks with decodes, or a prompt arriving at an idle server,
cannot replay a uniform graph: its query lengths vary. Run eagerly it is bound by the
host, not the device: on the H200 host, a 420-token prefill of the Qwen3-0.6B shape took
18-19 ms for 1.8 ms of device work (~110 GEMM and ~170 Triton launches), and that step is
most of a served request's time to first token.

So every layer's work outside attention is captured too, as vLLM's piecewise graphs do,
at a ladder of padded token counts: the forward is recorded as ``L + 1`` graphs split at
the ``L`` attention calls. A replay runs graph 0, then attention 0 eagerly on the step's
own metadata, graph 1, and so on; each attention reads the (fixed-address) q/k/v its graph
left and writes into a fixed output the next graph reads. Only attention depends on the
step's layout, so nothing else needs it.

Invariants:
- A step of ``n`` tokens replays the pieces of the smallest size ``>= n``. Its real rows
  come first; the padding rows read stale input ids and positions (persistent buffers,
  always valid values) and their outputs are never read: attention runs on the real rows
  only, and every other layer is row-wise.
- Pieces are captured from the model runner's persistent input buffers
  (``StepInputBuilder.token_buffers``), so the runner's gathers for an eager step fill
  exactly what the first graph reads.
- A model whose forward cannot be captured (data-dependent shapes, such as a MoE layer's
  routing) keeps the eager path: capture fails once, at start-up, and is logged.
- The sizes share their memory, since one step replays one size's pieces, start to end,
  before any other size's: every size is captured on one stream into the graph runner's
  pool, largest first, and once a size is captured its q/k/v are held by views that do
  not own their memory (as torch's own CUDA graph trees hold graph outputs), so the next
  size's capture reuses it; the attention outputs are the leading rows of the largest
  size's. Without this each of the 20 sizes kept its own q/k/v and outputs for every
  layer: 11,328 tokens' worth, 7 GB for llama-3-8b, allocated after the KV cache was
  sized, which left an 80 GB GPU out of memory on a 12k-token prefill.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedlm.attention.backend import AttentionBackend
from pagedlm.model_executor.forward_context import ForwardContext

logger = logging.getLogger(__name__)

MAX_TOKENS_ENV = "PAGEDLM_PIECEWISE_MAX_TOKENS"
"""Largest step (tokens) replayed from pieces; 0 turns piecewise graphs off."""
DEFAULT_MAX_TOKENS = 2048
"""Above this a step's GEMMs keep the device busy for longer than the host takes to launch
them, and padding to a size would cost more device time than the launches save."""


def piece_sizes(max_tokens: int) -> list[int]:
    """Padded token counts, fine where steps are short (a padded row costs a row of every
    GEMM): steps of 16 up to 64, 32 up to 256, 64 up to 512, 256 up to ``max_tokens``."""
    sizes = list(range(16, 65, 16)) + list(range(96, 257, 32)) + list(range(320, 513, 64))
    sizes += list(range(768, max(max_tokens, 768) + 1, 256))
    return [s for s in sizes if s <= max_tokens]


def max_piece_tokens(max_num_batched_tokens: int) -> int:
    value = int(os.environ.get(MAX_TOKENS_ENV, DEFAULT_MAX_TOKENS))
    return min(value, max_num_batched_tokens)


@dataclass(frozen=True)
class _AttentionCall:
    """One attention call as the pieces around it saw it: fixed-address inputs and output."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    scale: float
    kwargs: dict[str, Any]
    out: torch.Tensor


@dataclass(frozen=True)
class _Pieces:
    graphs: list[Any]
    """``len(calls) + 1`` captured ``torch.cuda.CUDAGraph``s, replayed in order."""
    calls: list[_AttentionCall]
    hidden: torch.Tensor


class _CallHook:
    """Stands in for the attention backend while a forward is recorded: every other
    attribute is the real backend's; ``forward`` hands the call to ``on_call``."""

    def __init__(self, backend: AttentionBackend, on_call: Any) -> None:
        self._backend = backend
        self._on_call = on_call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def forward(self, query, key, value, key_cache, value_cache, metadata, scale, **kwargs):
        return self._on_call(query, key, value, key_cache, value_cache, scale, kwargs)


def _output_dim(value: torch.Tensor, kwargs: dict[str, Any]) -> int:
    """Features per head of an attention call's output: the values' (latent attention:
    the first ``value_dim`` features of the key that is also the value)."""
    return kwargs.get("value_dim") or value.shape[2]


def _output_like(query: torch.Tensor, dim: int) -> torch.Tensor:
    return query.new_zeros((query.shape[0], query.shape[1], dim))


def _unowned(tensor: torch.Tensor) -> torch.Tensor:
    """A view of ``tensor``'s memory that does not keep it allocated: once the owning
    tensors are gone, a graph pool may hand that memory to a later capture."""
    storage = tensor.untyped_storage()
    unowned = torch._C._construct_storage_from_data_pointer(
        storage.data_ptr(), tensor.device, storage.nbytes()
    )
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return view.set_(unowned, tensor.storage_offset(), tensor.shape, tensor.stride())


def _unowned_inputs(call: _AttentionCall) -> _AttentionCall:
    """``call`` with unowned views of its q/k/v; a value that is the key (latent
    attention: ``value is key``) stays the key's view, as backends check."""
    key = _unowned(call.key)
    value = key if call.value is call.key else _unowned(call.value)
    return dataclasses.replace(call, query=_unowned(call.query), key=key, value=value)


class PiecewiseGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: Any,
        attn_backend: AttentionBackend,
        step_inputs: Any,
        sizes: list[int],
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.attn_backend = attn_backend
        self.step_inputs = step_inputs
        self.sizes = sizes
        self._pieces: dict[int, _Pieces] = {}
        self._outs: list[torch.Tensor] = []
        """The largest size's attention outputs; smaller sizes use their leading rows."""
        self.num_replays = 0

    @classmethod
    def for_model_runner(cls, runner: Any, pool: Any) -> PiecewiseGraphs | None:
        """Pieces for ``runner``'s model, captured into ``pool``; None when turned off or
        when its forward cannot be captured."""
        ladder = piece_sizes(max_piece_tokens(runner.config.scheduler.max_num_batched_tokens))
        sizes = runner.config.compilation.sizes(ladder)
        if not sizes:
            return None
        pieces = cls(runner.model, runner.kv_cache, runner.attn_backend, runner.step_inputs, sizes)
        start = time.perf_counter()
        try:
            pieces.capture(pool)
        except Exception as error:
            logger.warning("Piecewise CUDA graphs off (the forward cannot be captured): %s", error)
            return None
        logger.info(
            "Captured piecewise CUDA graphs for %d token counts (%d..%d) in %.1f s",
            len(sizes),
            sizes[0],
            sizes[-1],
            time.perf_counter() - start,
        )
        return pieces

    def capture(self, pool: Any) -> None:
        # The caching allocator reuses a freed block only for the stream it was allocated
        # on: one stream for every size (the graph runner's, where it captured).
        stream = torch.cuda.graph.default_capture_stream or torch.cuda.Stream()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._pieces[size] = self._capture_one(size, pool, stream)
        torch.cuda.synchronize()

    def _shared_output(self, index: int, query: torch.Tensor, dim: int) -> torch.Tensor:
        """Attention call ``index``'s output: rows of the largest size's where it fits."""
        out = self._outs[index] if index < len(self._outs) else None
        rows, heads = query.shape[0], query.shape[1]
        if out is None or out.shape[1:] != (heads, dim) or out.dtype != query.dtype:
            out = _output_like(query, dim)
            if index == len(self._outs):
                self._outs.append(out)
        return out[:rows]

    def _capture_one(self, size: int, pool: Any, stream: torch.cuda.Stream) -> _Pieces:
        input_ids, positions = self.step_inputs.token_buffers(size)
        shapes: list[tuple[torch.Tensor, int]] = []

        def warm(query, key, value, key_cache, value_cache, scale, kwargs):
            shapes.append((query, _output_dim(value, kwargs)))
            return _output_like(query, _output_dim(value, kwargs))

        # Once eagerly: compiles every kernel for this shape and warms the allocator.
        self.model(
            input_ids,
            positions,
            ForwardContext(_CallHook(self.attn_backend, warm), None, self.kv_cache),
        )
        outs = [self._shared_output(i, query, dim) for i, (query, dim) in enumerate(shapes)]
        shapes.clear()  # drop the warm-up tensors before capturing
        graphs = [torch.cuda.CUDAGraph() for _ in range(len(outs) + 1)]
        calls: list[_AttentionCall] = []

        def split(query, key, value, key_cache, value_cache, scale, kwargs):
            index = len(calls)
            graphs[index].capture_end()
            calls.append(
                _AttentionCall(
                    query, key, value, key_cache, value_cache, scale, kwargs, outs[index]
                )
            )
            graphs[index + 1].capture_begin(pool=pool)
            return outs[index]

        ctx = ForwardContext(_CallHook(self.attn_backend, split), None, self.kv_cache)
        stream.wait_stream(torch.cuda.current_stream())
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            graphs[0].capture_begin(pool=pool)
            try:
                hidden = self.model(input_ids, positions, ctx)
            except BaseException:
                graphs[len(calls)].capture_end()  # leave capture mode before reporting
                raise
            graphs[len(calls)].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        if len(calls) != len(outs):
            raise RuntimeError(
                f"the forward called attention {len(outs)} times warming up but "
                f"{len(calls)} times while captured"
            )
        # q/k/v live from their piece's end to their attention call, within this size's
        # replay: their memory may serve the next size's capture.
        calls = [_unowned_inputs(c) for c in calls]
        return _Pieces(graphs, calls, hidden)

    def padded_num_tokens(self, num_tokens: int) -> int | None:
        if not 0 < num_tokens <= self.sizes[-1]:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """Hidden states ``[padded tokens, hidden_size]`` of the step whose (eagerly
        gathered) inputs are ``input_ids`` and whose attention metadata ``ctx`` holds; None
        when no size serves it. Must not wait for the device."""
        num_tokens = input_ids.shape[0]
        size = self.padded_num_tokens(num_tokens)
        if size is None:
            return None
        pieces = self._pieces[size]
        self.num_replays += 1
        backend, metadata = self.attn_backend, ctx.attn_metadata
        for graph, call in zip(pieces.graphs, pieces.calls, strict=False):
            graph.replay()
            key = call.key[:num_tokens]
            out = backend.forward(
                call.query[:num_tokens],
                key,
                key if call.value is call.key else call.value[:num_tokens],  # latent: one
                call.key_cache,
                call.value_cache,
                metadata,
                call.scale,
                **call.kwargs,
            )
            call.out[:num_tokens].copy_(out)
        pieces.graphs[-1].replay()
        return pieces.hidden
