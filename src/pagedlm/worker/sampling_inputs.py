"""What the sampler reads about a step's sampling requests, taken from the input batch.

Nothing here needs the host to know the tokens of the step in flight: ``min_tokens`` needs
only how many outputs a request has (its length after the step, minus its prompt), and the
penalties read the tokens on the device, from ``InputBatch.token_ids``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

import numpy as np
import torch

from pagedlm.sample.metadata import SamplingMetadata
from pagedlm.sample.row import SamplingRow
from pagedlm.worker.input_batch import InputBatch, RequestState


def sampling_rows(states: Sequence[RequestState], seq_lens: np.ndarray) -> list[SamplingRow]:
    """One row per sampling request; ``seq_lens[i]``: tokens of ``states[i]`` before the one
    it samples now."""
    return [
        SamplingRow(state.sampling_params, state.generator, int(n) - state.num_prompt_tokens)
        for state, n in zip(states, seq_lens, strict=True)
    ]


def verification_rows(
    states: Sequence[RequestState], first_output: np.ndarray, num_rows: np.ndarray
) -> tuple[list[RequestState], np.ndarray]:
    """One entry per logits row: a request with ``num_rows[i]`` rows (its drafts plus one)
    repeats, its row ``j`` predicting the token after ``first_output[i] + j`` tokens (the
    drafts before it count as outputs, and penalties see them in the token table)."""
    if len(num_rows) == 0 or int(num_rows.max()) == 1:
        return list(states), first_output
    row_states = [
        state for state, count in zip(states, num_rows, strict=True) for _ in range(count)
    ]
    offsets = np.arange(int(num_rows.sum())) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
    return row_states, np.repeat(first_output, num_rows) + offsets


class SamplingMetadataCache:
    """Hands out the previous step's ``SamplingMetadata`` again when building it anew would
    give the same: the same requests sample, in the same order, and no row reads state that
    changes per step (penalties read the tokens so far; ``min_tokens`` masks the stop tokens
    until a request has enough outputs). A decode batch is built once, not every step."""

    def __init__(self) -> None:
        self._key: list[int] | None = None
        """The serials of the rows of the cached metadata; None: nothing reusable."""
        self._metadata: SamplingMetadata | None = None

    def get(
        self,
        states: Sequence[RequestState],
        seq_lens: np.ndarray,
        build: Callable[[], SamplingMetadata],
    ) -> SamplingMetadata:
        key = list(map(_serial, states))
        if key == self._key and self._metadata is not None:
            # Static when built, so still static: a request's output count only grows.
            return self._metadata
        per_step = any(
            state.needs_token_history
            or int(n) - state.num_prompt_tokens < state.sampling_params.min_tokens
            for state, n in zip(states, seq_lens, strict=True)
        )
        self._key, self._metadata = (None if per_step else key), build()
        return self._metadata


_serial = attrgetter("serial")


class DeviceTokenHistory:
    """A ``TokenHistory`` (``pagedlm.sample.penalties``) over the batch's token table."""

    def __init__(
        self, batch: InputBatch, states: Sequence[RequestState], seq_lens: np.ndarray
    ) -> None:
        self.batch = batch
        self.states = states
        self.seq_lens = seq_lens

    def __call__(self, rows: Sequence[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = np.array([self.states[r].slot for r in rows], dtype=np.int64)
        prompt_lens = np.array([self.states[r].num_prompt_tokens for r in rows], dtype=np.int64)
        seq_lens = self.seq_lens[list(rows)].astype(np.int64)
        prompt = self._gather(slots, np.zeros_like(prompt_lens), prompt_lens, pad_id)
        output = self._gather(slots, prompt_lens, seq_lens, pad_id)
        return prompt, output

    def _gather(
        self, slots: np.ndarray, starts: np.ndarray, ends: np.ndarray, pad_id: int
    ) -> torch.Tensor:
        """``[len(slots), max(ends - starts)]``: token_ids[slot, start:end] right-padded."""
        device = self.batch.device
        width = int((ends - starts).max(initial=0))
        table = self.batch.token_ids
        base = torch.from_numpy(slots * table.shape[1] + starts).to(device)
        lengths = torch.from_numpy(ends - starts).to(device)
        offsets = torch.arange(width, device=device)
        index = base[:, None] + offsets[None, :]
        valid = offsets[None, :] < lengths[:, None]
        tokens = table.view(-1)[torch.where(valid, index, 0)].to(torch.int64)
        return torch.where(valid, tokens, pad_id)
