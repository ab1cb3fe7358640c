"""Verifying drafted tokens so that the output keeps the target model's distribution.

A request that verifies ``k`` drafts has ``1 + k`` logits rows: row ``j`` is the target's
distribution for the token after its first ``j`` drafts. Every row goes through the
sampler's stages (grammar mask, logit bias, ``min_tokens``, penalties, temperature,
min-p/top-k/top-p), giving the target distribution ``p_j``; then, per request, on the
device (Leviathan et al. / Chen et al., 2023):

- greedy rows: draft ``j`` is accepted while it equals ``argmax p_j``; the first row that
  disagrees (or row ``k``) emits its argmax: the longest matching prefix plus one token;
- random rows: draft ``d_j``, drawn by the proposer from ``q_j``, is accepted with
  probability ``min(1, p_j(d_j) / q_j(d_j))``; the first rejected row emits a token drawn
  from ``max(0, p_j - q_j)`` normalized, and if all ``k`` are accepted row ``k`` emits a
  token drawn from ``p_k``. Every emitted token is then distributed exactly as ``p``.
  Proposers that draft deterministically (n-gram, greedy draft models and EAGLE heads, as
  in vLLM) have ``q_j`` one-hot at ``d_j``: acceptance with probability ``p_j(d_j)``, and
  on rejection a draw from ``p_j`` without ``d_j``.

Only the first ``num_verified[i]`` drafts of a request are verified (a proposer may have
drafted fewer than were scheduled); the row after them is its bonus row. Seeded requests
draw their uniforms and their race noise from their own generator, row by row. Logprobs are
those of the emitted token of each row, from the raw logits (as the sampler's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from pagedlm.sample.host_copy import arrays_to_device
from pagedlm.sample.logprobs import LogprobsTensors
from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.sampler import Sampler
from pagedlm.structured_output.bitmask import apply_token_bitmask


class RejectionOutput(NamedTuple):
    """``token_ids``: ``[N, W]`` int64 (``W`` = the most rows of a request); request ``i``
    emits ``token_ids[i, :num_emitted[i]]`` (``num_emitted``: ``[N]`` int64, at least 1).
    ``logprobs``: one row per logits row (the token that row emitted; rows after a
    request's last emitted one are meaningless), or None."""

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    logprobs: LogprobsTensors | None


FusedGreedyVerifier = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
"""A platform's verification of an all-greedy step, what ``RejectionSampler`` and
``Speculator.verify`` do for it, in few launches; called with ``(logits [R, V],
input_ids, logits_indices, last_token, row_starts [N + 1], slots [N], num_valid,
sample_token_index [N], token_table, num_rejected, width)``. Request ``i`` owns logits rows
``row_starts[i] .. row_starts[i + 1] - 1`` and its slot ``slots[i]``; row ``j``'s draft is
``input_ids[min(logits_indices[row] + 1, last_token)]``, and the first ``min(rows - 1,
num_valid[slot])`` drafts are verified against their rows' argmax (the first index among
ties). Writes each row's argmax into ``token_table`` (flat, int32) from
``sample_token_index[i]`` on and ``rows - num_emitted`` into ``num_rejected[slot]``
(int32); returns the token grid ``[N, width]`` int64 (each row's argmax, zeros past a
request's rows), ``num_emitted`` ``[N]`` int64 (the accepted run plus one) and each row's
argmax ``[R]`` int64."""


class RejectionSampler:
    """Stateless apart from the sampler whose stages it reuses."""

    def __init__(self, sampler: Sampler | None = None) -> None:
        self.sampler = sampler or Sampler()

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's argmax through the kernel a plain greedy step takes: the platform's
        fused sampler where it has one (on the H100 ``torch.max`` took 27 us over five
        Llama-3 logits rows), else the sampler's argmax."""
        fused = self.sampler.fused_random
        return fused(logits, None, None, None) if fused is not None else self.sampler.argmax(logits)

    def __call__(
        self,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        draft_token_ids: torch.Tensor,
        num_rows: np.ndarray,
        num_verified: torch.Tensor,
        token_bitmask: torch.Tensor | None = None,
        draft_probs: torch.Tensor | None = None,
        row_map: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> RejectionOutput:
        """``logits``: ``[R, vocab]``, ``num_rows[i]`` consecutive rows per request (host
        ints, ``R = num_rows.sum()``); ``metadata``: one ``SamplingRow`` per logits row.
        ``draft_token_ids``: ``[R]`` int64, row ``j``'s draft (the token fed after row
        ``j``'s position; ignored past a request's verified drafts). ``num_verified``:
        ``[N]`` int64 on the device, ``<= num_rows - 1``. ``draft_probs``: ``[R, vocab]``
        the proposer's ``q`` per row, or None for deterministic drafts. ``row_map``: each
        row's request and position within it (``[R]`` int64 device each), if the caller
        has them on the device already."""
        device = logits.device
        rows = _RowMap(num_rows, device, row_map)
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, token_bitmask)
        raw_logits = logits
        adjusted = Sampler.adjust_logits(logits, metadata)
        drafts = draft_token_ids.clamp(min=0)
        is_draft = rows.position < num_verified[rows.request]
        greedy = None if metadata.all_random else self._argmax(adjusted)
        processed = adjusted
        if metadata.all_greedy:
            assert greedy is not None
            accepted, fallback = drafts == greedy, greedy
        else:
            processed = Sampler.processed_logits(adjusted, metadata)
            probs = processed.softmax(dim=-1)
            accepted, fallback = self._random(probs, drafts, is_draft, metadata, draft_probs)
            if greedy is not None and metadata.greedy_mask is not None:
                accepted = torch.where(metadata.greedy_mask, drafts == greedy, accepted)
                fallback = torch.where(metadata.greedy_mask, greedy, fallback)
        accepted &= is_draft
        # The accepted run of each request: its drafts up to the first rejection.
        grid, draft_grid, fallback_grid = (
            rows.to_grid(values) for values in (accepted.to(torch.int64), drafts, fallback)
        )
        num_accepted = grid.cumprod(dim=1).sum(dim=1)
        columns = torch.arange(rows.width, device=device)
        token_ids = torch.where(columns < num_accepted[:, None], draft_grid, fallback_grid)
        logprobs = None
        if metadata.max_num_logprobs is not None:
            emitted = token_ids[rows.request, rows.position]
            logprobs = self.sampler.logprobs(
                raw_logits, processed, emitted, metadata.max_num_logprobs
            )
        return RejectionOutput(token_ids, num_accepted + 1, logprobs)

    def _random(
        self,
        probs: torch.Tensor,
        drafts: torch.Tensor,
        is_draft: torch.Tensor,
        metadata: SamplingMetadata,
        draft_probs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted [R] bool, the token each row emits if it is the first rejected or the
        bonus row [R]) for random rows."""
        target = probs.gather(1, drafts[:, None]).squeeze(1)
        uniform = _uniforms(probs.shape[0], metadata, probs.device)
        if draft_probs is None:
            accepted = uniform < target  # q(d) = 1
            residual = probs.scatter(1, drafts[:, None], 0.0)
        else:
            proposal = draft_probs.gather(1, drafts[:, None]).squeeze(1)
            accepted = uniform * proposal < target
            residual = (probs - draft_probs).clamp_(min=0.0)
        # Rows without a verified draft (the bonus row) draw from p itself.
        residual = torch.where(is_draft[:, None], residual, probs)
        return accepted, self.sampler.race(residual, metadata)


def _uniforms(num_rows: int, metadata: SamplingMetadata, device: torch.device) -> torch.Tensor:
    """One U(0, 1) per row; seeded rows from their own generators."""
    uniform = torch.empty(num_rows, dtype=torch.float32, device=device)
    if metadata.has_unseeded_random_rows:
        uniform.uniform_(generator=metadata.default_generator)
    else:
        uniform.fill_(0.5)  # every random row is seeded; greedy rows discard theirs
    for row, generator in metadata.seeded_rows:
        uniform[row : row + 1].uniform_(generator=generator)
    return uniform


class _RowMap:
    """Which request and which position each logits row is (device int64 ``[R]`` each)."""

    def __init__(
        self,
        num_rows: np.ndarray,
        device: torch.device,
        on_device: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        counts = np.asarray(num_rows, dtype=np.int64)
        if on_device is None:
            starts = np.cumsum(counts) - counts
            request = np.repeat(np.arange(len(counts)), counts)
            position = np.arange(int(counts.sum())) - np.repeat(starts, counts)
            on_device = tuple(arrays_to_device([request, position], device))
        self.request, self.position = on_device
        self.num_requests = len(counts)
        self.width = int(counts.max(initial=1))
        self.uniform = bool(len(counts)) and int(counts.min()) == self.width
        """Every request has ``width`` rows (a verification step of one k for all)."""

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """[R] per-row values -> [num_requests, width], zeros past a request's rows: a
        view when every request has ``width`` rows (no scatter to launch)."""
        if self.uniform:
            return values.view(self.num_requests, self.width)
        grid = values.new_zeros((self.num_requests, self.width))
        grid[self.request, self.position] = values
        return grid
