"""A small draft model of any supported architecture that shares the target's vocabulary.

Its KV covers every position the target has fed (``observe`` runs it over each step's own
tokens: prefill chunks, plain decodes and verifications, whose rejected positions are
overwritten later). Drafting feeds the step's last emitted token, then each draft, one
position at a time, and takes the argmax (greedy drafts, as in vLLM).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from pagedlm.attention.backend import BatchLayout
from pagedlm.config import ModelConfig
from pagedlm.model_executor.layers.attention import model_kv_geometry
from pagedlm.model_executor.loader import load_model
from pagedlm.platforms.interface import GraphRunner
from pagedlm.spec_decode.model_drafter import ModelDrafter, TargetParts
from pagedlm.spec_decode.proposer import ProposalRequests, SampledStep
from pagedlm.worker.input_batch import InputBatch


class DraftModelProposer(ModelDrafter):
    def __init__(self, batch: InputBatch, target: TargetParts, draft: ModelConfig) -> None:
        model = load_model(draft, batch.device)
        target.platform.prepare_model(model)
        arch = draft.arch
        geometry = model_kv_geometry(model, arch.num_key_value_heads, arch.head_dim)
        super().__init__(batch, target, arch.num_hidden_layers, geometry)
        self.model = model
        self.observe_graphs: GraphRunner | None = None

    def capture_graphs(self, runner: object) -> None:
        super().capture_graphs(runner)
        # Its forward over each step's own tokens replays from graphs over the runner's
        # step buffers, at the shapes the target's graphs have. The target's step has
        # gathered those buffers already (and its sampling may since have overwritten the
        # token table's drafts), so these graphs gather nothing.
        step_inputs = runner.step_inputs  # type: ignore[attr-defined]
        self.observe_graphs = self.target.platform.capture_graphs(
            SimpleNamespace(
                model=self.model,
                kv_cache=self.kv_cache,
                attn_backend=self.attn_backend,
                step_inputs=SimpleNamespace(
                    capture_inputs=step_inputs.capture_inputs, gather=lambda inputs: None
                ),
                config=runner.config,  # type: ignore[attr-defined]
            )
        )

    def release_kv_cache(self) -> None:
        super().release_kv_cache()
        self.observe_graphs = None

    def weight_modules(self) -> list[nn.Module]:
        return [self.model]

    def observe(self, step: SampledStep) -> None:
        inputs = step.inputs
        if inputs.padded_num_reqs is not None and self.observe_graphs is not None:
            self.observe_graphs.run(inputs.layout)  # the target's step ran from a graph too
            return
        self.model(inputs.input_ids, inputs.positions, self.context(inputs.layout))

    def propose(
        self, step: SampledStep, requests: ProposalRequests
    ) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.batch.device
        last = self.batch.token_ids[requests.slots_device, requests.num_tokens - 1]
        drafts = torch.zeros(
            (len(requests.slots), requests.max_drafts), dtype=torch.int64, device=device
        )
        self.decode(requests, drafts, 0, last, None, -1, self._draft_step)
        return drafts, requests.num_drafts_device

    @property
    def step_module(self) -> torch.nn.Module:
        return self.model

    def _draft_step(
        self, layout: BatchLayout, num_reqs: int, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.forward_step(layout, num_reqs)
        return self.model.compute_logits(out).argmax(dim=-1), None
