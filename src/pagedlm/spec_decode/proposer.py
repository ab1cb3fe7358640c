"""The proposer interface: what drafts a request's next tokens on the worker, after each step.

The model runner calls, per non-empty step, after the step's sampled tokens are in the
token table (``InputBatch.token_ids``):

1. ``observe(step)`` with every step, so a proposer that keeps KV of its own (a draft
   model, an EAGLE head) computes it for the step's tokens, prefill chunks included;
2. ``propose(step, requests)`` for the requests the scheduler asked for drafts
   (``SchedulerOutput.num_drafts_to_propose``): up to ``requests.num_drafts[i]`` tokens
   each, following the last token the step emitted for it.

Invariants:
- Nothing waits for the device: every position is read from device tensors (the host may
  not know how many drafts a verification accepted); host copies are bounds unless exact.
- A proposer writes KV only at slots the scheduler gave the request: positions below
  ``requests.num_tokens + requests.num_drafts - 1`` (``KV_LOOKAHEAD`` proposers get slots
  ahead for it).
- Drafts are deterministic functions of the request's tokens (``q`` one-hot), which the
  rejection sampler's distribution argument relies on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedlm.step import NewRequestData
from pagedlm.worker.input_batch import InputBatch
from pagedlm.worker.step_inputs import StepInputs

Allocate = Callable[..., object]
"""``(num_blocks, num_layers, num_kv_heads, head_dim, shares_values=False) -> KVCache`` in
the target's layout (``shares_values``: one latent tensor per layer, keys as values)."""


@dataclass(frozen=True)
class SampledStep:
    """A step whose outputs are in the token table: what proposers read.

    ``hidden``: the target's final hidden states ``[layout.num_tokens, hidden_size]``.
    ``num_emitted``: ``[len(inputs.sampled)]`` int64 device, tokens each sampled request
    emitted (1 + accepted drafts).
    """

    inputs: StepInputs
    hidden: torch.Tensor
    num_emitted: torch.Tensor


@dataclass(frozen=True)
class ProposalRequests:
    """The requests that propose after a step.

    ``sampled_index[i]``: the request's index in ``step.inputs.sampled``; ``slots[i]``
    its slot; ``num_drafts[i]`` how many drafts it wants (host ints, at least 1).
    ``num_tokens``: ``[m]`` int64 device, tokens in its row now (its drafts go at
    positions ``num_tokens + j``); ``num_tokens_host`` the same on the host, exact when
    ``exact`` else an upper bound. ``sampled_index_device``, ``slots_device`` and
    ``num_drafts_device``: those host arrays as int64 device tensors (copied with the
    step's other index arrays, so proposers copy none).
    """

    sampled_index: np.ndarray
    slots: np.ndarray
    num_drafts: np.ndarray
    num_tokens: torch.Tensor
    num_tokens_host: np.ndarray
    exact: bool
    sampled_index_device: torch.Tensor
    slots_device: torch.Tensor
    num_drafts_device: torch.Tensor

    @property
    def max_drafts(self) -> int:
        return int(self.num_drafts.max())


class Proposer(ABC):
    """Drafts tokens for the requests of one worker (see the module docstring)."""

    KV_LOOKAHEAD = False
    """Whether it writes KV for the draft positions (the scheduler then holds slots)."""

    def __init__(self, batch: InputBatch) -> None:
        self.batch = batch

    def kv_bytes_per_block(self) -> int:
        """Bytes its own KV takes per block (0: none)."""
        return 0

    def initialize_kv_cache(self, num_blocks: int, allocate: Allocate) -> None:  # noqa: B027
        """Allocate its own KV for ``num_blocks`` blocks (the target's block ids)."""

    def capture_graphs(self, runner: object) -> None:  # noqa: B027
        """Capture its forwards as graphs, where the platform replays graphs; ``runner``
        is the model runner (its ``config`` and persistent ``step_inputs``)."""

    def release_kv_cache(self) -> None:  # noqa: B027
        """Drop its own KV cache and the graphs that point into it (sleep mode);
        ``initialize_kv_cache`` and ``capture_graphs`` make them again."""

    def weight_modules(self) -> list[nn.Module]:
        """The modules whose weights it holds besides the target's (sleep mode moves them
        to host memory with the target's; a tensor shared with the target moves once)."""
        return []

    def admit(self, data: NewRequestData, slot: int) -> None:  # noqa: B027
        """A request (re)admitted into ``slot``."""

    def observe(self, step: SampledStep) -> None:  # noqa: B027
        """Every non-empty step, before ``propose``."""

    @abstractmethod
    def propose(
        self, step: SampledStep, requests: ProposalRequests
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(drafts [m, requests.max_drafts] int64, num_valid [m] int64)`` on the device:
        request ``i``'s first ``num_valid[i] <= num_drafts[i]`` drafts are meant; the rest
        of its row is filler the rejection sampler will not verify."""
