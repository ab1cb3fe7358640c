"""What the model-based proposers (draft model, EAGLE heads) share.

Their KV lives in the paged cache: tensors of their own, indexed by the target's block ids,
so a request's block table serves both (prefix-cache hits included: a cached block's
draft KV was written by the request that filled it). Each step they run a forward over
the step's own layout to keep that KV complete (``observe``), then draft one token per
forward for the proposing requests (``decode``): requests wanting fewer drafts drop out of
the later forwards, so no KV is written past the slots the scheduler gave them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np
import torch
from torch import nn

from pagedlm.attention.backend import AttentionBackend, BatchLayout
from pagedlm.kv_cache.interface import KVCache, kv_bytes_per_block
from pagedlm.model_executor.forward_context import ForwardContext
from pagedlm.model_executor.layers.attention import KVGeometry
from pagedlm.platforms import Platform
from pagedlm.platforms.interface import GraphRunner
from pagedlm.sample.host_copy import tensor_to_device
from pagedlm.spec_decode.draft_steps import DraftSteps
from pagedlm.spec_decode.proposer import Allocate, ProposalRequests, Proposer
from pagedlm.worker.input_batch import InputBatch


@dataclass(frozen=True)
class TargetParts:
    """What a model-based proposer may use of the model runner."""

    model: nn.Module
    attn_backend: AttentionBackend
    platform: Platform
    dtype: torch.dtype
    max_num_tokens: int
    """The most tokens one step feeds (``max_num_batched_tokens``)."""
    kv_cache_dtype: torch.dtype | None = None
    """What the KV caches store (an FP8 cache's float8); None: ``dtype``."""
    weights: list[tuple[str, torch.Tensor]] | None = None
    """The ``(name, tensor)`` pairs the target was just loaded from (a weight update from
    tensors); None: its checkpoint's files."""


DraftStep = Callable[
    [BatchLayout, int, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]
]
"""``(layout, n, hidden [n, H] | None) -> (next draft [n], hidden for the next forward |
None)``: one draft forward over the first ``n`` rows of ``layout`` (the rest padding)."""


class ModelDrafter(Proposer):
    KV_LOOKAHEAD = True

    def __init__(
        self,
        batch: InputBatch,
        target: TargetParts,
        num_layers: int,
        geometry: KVGeometry,
    ) -> None:
        super().__init__(batch)
        # Not the tensors a weight update passed: a proposer lives as long as its runner,
        # and they would keep a second copy of the target's weights alive after the caller's.
        self.target = replace(target, weights=None)
        self.attn_backend = target.attn_backend
        self.num_layers = num_layers
        self.geometry = geometry
        self.steps = DraftSteps(batch)
        self.kv_cache: KVCache | None = None
        self.graphs: GraphRunner | None = None

    @property
    def step_module(self) -> nn.Module:
        """``(input_ids, positions, ctx) -> hidden``: one draft forward over the persistent
        step buffers (what graphs capture)."""
        raise NotImplementedError

    def capture_graphs(self, runner: object) -> None:
        """Capture the draft forwards through the platform's graph hooks (they see this
        proposer as a model runner of one token per request)."""
        config = runner.config  # type: ignore[attr-defined]
        # Draft steps are uniform (one token per request): full graphs where the target's
        # are on, never the piecewise graphs of mixed steps.
        full = config.compilation.full_graphs
        draft_graphs = replace(
            config.compilation, cudagraph_mode="FULL_DECODE_ONLY" if full else "NONE"
        )
        drafts = SimpleNamespace(
            model=self.step_module,
            kv_cache=self.kv_cache,
            attn_backend=self.attn_backend,
            step_inputs=self.steps,
            config=SimpleNamespace(
                scheduler=config.scheduler, compilation=draft_graphs, speculative=None
            ),
        )
        self.graphs = self.target.platform.capture_graphs(drafts)

    def forward_step(self, layout: BatchLayout, num_reqs: int) -> torch.Tensor:
        """The step module over ``layout`` (from a graph when it is padded to one), the
        first ``num_reqs`` rows of its output."""
        if (
            self.graphs is not None
            and self.graphs.padded_num_reqs(layout.num_reqs, 1) == layout.num_reqs
        ):
            return self.graphs.run(layout)[:num_reqs]
        ids, positions = (
            self.steps.input_ids[: layout.num_reqs],
            self.steps.positions[: layout.num_reqs],
        )
        return self.step_module(ids, positions, self.context(layout))[:num_reqs]

    def kv_bytes_per_block(self) -> int:
        geometry = self.geometry
        return kv_bytes_per_block(
            self.batch.block_size,
            self.num_layers,
            geometry.num_kv_heads,
            geometry.head_dim,
            self.target.kv_cache_dtype or self.target.dtype,
            shares_values=geometry.shares_values,
        )

    def initialize_kv_cache(self, num_blocks: int, allocate: Allocate) -> None:
        geometry = self.geometry
        self.kv_cache = allocate(  # type: ignore[assignment]
            num_blocks,
            self.num_layers,
            geometry.num_kv_heads,
            geometry.head_dim,
            shares_values=geometry.shares_values,
        )

    def release_kv_cache(self) -> None:
        self.kv_cache = None
        self.graphs = None

    def context(self, layout: BatchLayout) -> ForwardContext:
        assert self.kv_cache is not None, "initialize_kv_cache must run first"
        return ForwardContext(
            self.attn_backend, self.attn_backend.build_metadata(layout), self.kv_cache
        )

    def decode(
        self,
        requests: ProposalRequests,
        drafts: torch.Tensor,
        first: int,
        token_ids: torch.Tensor,
        hidden: torch.Tensor | None,
        position_offset: int,
        step: DraftStep,
    ) -> torch.Tensor:
        """Fill ``drafts[:, first:]`` (``[m, max_drafts]``): draft ``j`` of request ``i``
        feeds ``token_ids`` (then the previous draft) at position ``num_tokens[i] +
        position_offset + j``; request ``i`` takes part while ``j < num_drafts[i]``."""
        device = self.batch.device
        active = np.arange(len(requests.slots))
        slots = requests.slots_device
        num_tokens = requests.num_tokens
        num_tokens_host = requests.num_tokens_host
        for j in range(first, requests.max_drafts):
            still = np.flatnonzero(requests.num_drafts[active] > j)
            if len(still) < len(active):
                keep = tensor_to_device(torch.from_numpy(still), device)
                active = active[still]
                slots, num_tokens = slots[keep], num_tokens[keep]
                token_ids = token_ids[keep]
                hidden = None if hidden is None else hidden[keep]
            num_tokens_host = requests.num_tokens_host[active]
            positions = num_tokens + position_offset + j
            padded = None if self.graphs is None else self.graphs.padded_num_reqs(len(active), 1)
            layout = self.steps.layout(
                slots,
                token_ids,
                positions.to(torch.int32),
                num_tokens_host + position_offset + j,
                padded,
            )
            token_ids, hidden = step(layout, len(active), hidden)
            drafts[tensor_to_device(torch.from_numpy(active), device), j] = token_ids
        return drafts
