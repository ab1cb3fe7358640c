"""Drives an attention backend through steps as the model runner does, checking each step
against the float64 reference.

Each simulated request has random queries, keys and values for all its positions, and a
block table drawn from a shuffled pool (one block longer than it needs, as reserved
blocks are). A step schedules some tokens of some requests: it is laid out as a
``BatchLayout``, run through ``build_metadata`` and ``forward`` on the backend's own KV
cache, and every request's rows are compared with the reference over its positions.

The kit never reads the cache directly (its layout is the backend's); it fills it with
large random values first, so that reading a slot no step wrote shows in the results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedlm.attention import BatchLayout
from pagedlm.testing.promises import ConformanceFailure
from pagedlm.testing.reference import reference_attention, relative_error
from pagedlm.testing.target import AttentionTarget, HeadShape

GARBAGE_SCALE = 30.0
"""Magnitude of what fills unwritten slots: read by mistake, it dominates the scores."""


@dataclass
class SimRequest:
    query: torch.Tensor
    """[length, num_heads, head_dim] in the target dtype, on the host."""
    key: torch.Tensor
    """[length, num_kv_heads, head_dim]."""
    value: torch.Tensor
    block_table: list[int]
    num_computed: int = 0

    @property
    def length(self) -> int:
        return self.query.shape[0]


@dataclass(frozen=True)
class RowsOfStep:
    """One step laid out on the host: what a layout and ``forward`` are built from."""

    plan: tuple[tuple[int, int], ...]
    """(request index, tokens scheduled) per request, in batch order."""
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: list[int]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


class PagedSteps:
    """One backend instance, its KV cache and the simulated requests (see module doc)."""

    def __init__(
        self,
        target: AttentionTarget,
        shape: HeadShape,
        block_size: int,
        *,
        num_blocks: int = 48,
        seed: int = 0,
        query_scale: float = 1.0,
        value_dim: int | None = None,
    ) -> None:
        """``value_dim``: latent attention (``supports_latent_kv``): one kv head whose
        first ``value_dim`` features are the values, one cache tensor."""
        if value_dim is not None:
            shape = type(shape)(shape.num_heads, 1, shape.head_dim)
        self.value_dim = value_dim
        self.target = target
        self.shape = shape
        self.block_size = block_size
        self.query_scale = query_scale
        self.scale = shape.head_dim**-0.5
        self.generator = torch.Generator().manual_seed(seed)
        self.backend = target.new_backend()
        cache_shape = tuple(
            target.backend_cls.kv_cache_shape(
                num_blocks, block_size, shape.num_kv_heads, shape.head_dim
            )
        )
        self.key_cache = target.allocate(cache_shape)
        self.value_cache = self.key_cache if value_dim else target.allocate(cache_shape)
        for cache in {id(c): c for c in (self.key_cache, self.value_cache)}.values():
            cache.copy_(self.random_tensor(cache_shape, GARBAGE_SCALE))
        self._free_blocks = torch.randperm(num_blocks, generator=self.generator).tolist()
        self.requests: list[SimRequest] = []

    def describe(self) -> str:
        latent = "" if self.value_dim is None else f", value_dim {self.value_dim}"
        return f"block_size {self.block_size}, {self.shape}{latent}, {self.target.dtype}"

    def random_tensor(self, shape: Sequence[int], scale: float = 1.0) -> torch.Tensor:
        values = torch.randn(tuple(shape), generator=self.generator) * scale
        return values.to(self.target.dtype)

    def add(
        self, length: int, *, shares_blocks_of: int | None = None, shared_blocks: int = 0
    ) -> int:
        """A new request of ``length`` positions; with ``shares_blocks_of``, its first
        ``shared_blocks`` blocks are that request's (same tokens, hence same K/V: a prefix
        cache hit). Returns its index."""
        num_heads, num_kv_heads, head_dim = self.shape
        query = self.random_tensor((length, num_heads, head_dim), self.query_scale)
        key = self.random_tensor((length, num_kv_heads, head_dim))
        value = key if self.value_dim else self.random_tensor((length, num_kv_heads, head_dim))
        table: list[int] = []
        if shares_blocks_of is not None:
            owner = self.requests[shares_blocks_of]
            table = owner.block_table[:shared_blocks]
            shared = shared_blocks * self.block_size
            key[:shared] = owner.key[:shared]
            value[:shared] = owner.value[:shared]
        needed = -(-length // self.block_size) + 1 - len(table)
        if needed > len(self._free_blocks):
            raise RuntimeError("the kit's block pool is too small for its own scenario")
        table += [self._free_blocks.pop() for _ in range(needed)]
        self.requests.append(SimRequest(query, key, value, table))
        return len(self.requests) - 1

    def skip(self, index: int, num_tokens: int) -> None:
        """Move request ``index`` by ``num_tokens`` positions without a step: forward past
        shared blocks another request computes, or back (negative) to compute them again."""
        self.requests[index].num_computed += num_tokens

    def rows(self, plan: Sequence[tuple[int, int]], zero_queries: bool = False) -> RowsOfStep:
        query_start_loc, seq_lens, tables, slots = [0], [], [], []
        queries, keys, values = [], [], []
        for index, num_tokens in plan:
            request = self.requests[index]
            start, end = request.num_computed, request.num_computed + num_tokens
            if end > request.length:
                raise RuntimeError("the kit scheduled a request past its length")
            query_start_loc.append(query_start_loc[-1] + num_tokens)
            seq_lens.append(end)
            tables.append(request.block_table)
            block_size, table = self.block_size, request.block_table
            slots += [
                table[p // block_size] * block_size + p % block_size for p in range(start, end)
            ]
            query = request.query[start:end]
            queries.append(torch.zeros_like(query) if zero_queries else query)
            keys.append(request.key[start:end])
            values.append(request.value[start:end])
        return RowsOfStep(
            tuple(plan),
            query_start_loc,
            seq_lens,
            tables,
            slots,
            torch.cat(queries),
            torch.cat(keys),
            torch.cat(values),
        )

    def layout(self, rows: RowsOfStep) -> BatchLayout:
        return BatchLayout.from_lists(
            rows.query_start_loc,
            rows.seq_lens,
            rows.block_tables,
            rows.slot_mapping,
            self.block_size,
            self.target.device,
        )

    def call(self, promise: str, what: str, function: Callable[..., Any], *args, **kwargs) -> Any:
        """``function(*args, **kwargs)``; an exception it raises is a failure of ``promise``."""
        try:
            return function(*args, **kwargs)
        except ConformanceFailure:
            raise
        except Exception as exc:
            raise ConformanceFailure(
                self.target.name,
                promise,
                f"{self.describe()}: {what} raised {type(exc).__name__}: {exc}",
            ) from exc

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        metadata: object,
        promise: str,
        **features,
    ) -> torch.Tensor:
        """``backend.forward`` over this object's caches; a raise or a malformed result is a
        failure of ``promise`` (or of 'output')."""
        out_shape = tuple(query.shape)
        if self.value_dim is not None:
            value = key  # the contract: one tensor
            features = {**features, "value_dim": self.value_dim}
            out_shape = (*out_shape[:-1], self.value_dim)
        out = self.call(
            promise,
            "forward",
            self.backend.forward,
            query,
            key,
            value,
            self.key_cache,
            self.value_cache,
            metadata,
            self.scale,
            **features,
        )
        expected = (out_shape, query.dtype, query.device.type)
        got = (tuple(out.shape), out.dtype, out.device.type)
        if got != expected:
            raise ConformanceFailure(
                self.target.name, "output", f"{self.describe()}: got {got}, expected {expected}"
            )
        return out

    def on_device(self, rows: RowsOfStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(t.to(self.target.device) for t in (rows.query, rows.key, rows.value))

    def step(
        self,
        plan: Sequence[tuple[int, int]],
        promise: str,
        *,
        zero_queries: bool = False,
        verify: bool = True,
        **features,
    ) -> float:
        """Run one eager step, check it (unless not ``verify``: a step that only writes),
        advance the requests. Returns how far the reference without ``features`` is from
        the one with them (0 without features), so a check can tell whether its case
        exercises them."""
        rows = self.rows(plan, zero_queries)
        metadata = self.call(
            promise, "build_metadata", self.backend.build_metadata, self.layout(rows)
        )
        out = self.forward(*self.on_device(rows), metadata, promise, **features)
        effect = self.check(rows, out, promise, **features) if verify else 0.0
        self.advance(rows.plan)
        return effect

    def check(self, rows: RowsOfStep, out: torch.Tensor, promise: str, **features) -> float:
        """Compare each request's rows of ``out`` with the reference (raising a failure of
        ``promise`` naming the worst request); returns the features' effect."""
        tolerance = self.target.max_relative_error
        worst: tuple[float, int, float] | None = None
        effect = 0.0
        for (index, num_tokens), start in zip(rows.plan, rows.query_start_loc):
            ref = self._reference(rows, index, start, num_tokens, **features)
            error = relative_error(out[start : start + num_tokens], ref)
            plain = ref
            if features:
                plain = self._reference(rows, index, start, num_tokens)
                effect = max(effect, relative_error(plain, ref))
            if error > tolerance and (worst is None or error > worst[0]):
                worst = (error, index, relative_error(out[start : start + num_tokens], plain))
        if worst is not None:
            error, index, plain_error = worst
            request = self.requests[index]
            num_tokens = dict(rows.plan)[index]
            detail = (
                f"{self.describe()}: request {index} ({request.num_computed} cached + "
                f"{num_tokens} new tokens of {request.length}) has relative error "
                f"{error:.3g} > {tolerance:.3g}"
            )
            if features and plain_error <= tolerance:
                detail += f"; it matches attention without {sorted(features)}: they are ignored"
            raise ConformanceFailure(self.target.name, promise, detail)
        return effect

    def _reference(
        self, rows: RowsOfStep, index: int, start: int, num_tokens: int, **features
    ) -> torch.Tensor:
        request = self.requests[index]
        end = request.num_computed + num_tokens
        positions = torch.arange(request.num_computed, end)
        values = request.value[:end]
        if self.value_dim is not None:
            values = values[..., : self.value_dim]
        return reference_attention(
            rows.query[start : start + num_tokens],
            request.key[:end],
            values,
            positions,
            self.scale,
            **features,
        )

    def advance(self, plan: Sequence[tuple[int, int]]) -> None:
        for index, num_tokens in plan:
            self.requests[index].num_computed += num_tokens
