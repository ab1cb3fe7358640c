"""Repetition, frequency and presence penalties, batched over the rows that ask for them.

Semantics (those of vLLM, which follow HF and OpenAI):

- repetition (HF): every token seen in the prompt *or* the output so far has its logit
  divided by the penalty when positive and multiplied by it when not, so a penalty > 1
  always makes a seen token less likely.
- frequency and presence (OpenAI), over *output* tokens only:
  ``logit -= frequency * count + presence * (count > 0)``.

Token histories come from a ``TokenHistory`` as padded ``[num_penalized_rows, max_len]`` id
tensors on the device (padding id = ``vocab_size``; the model runner gathers them from its
device token table, so the tokens the step in flight sampled count without the host seeing
them) and become counts with one ``scatter_add_`` into a
``[num_penalized_rows, vocab_size + 1]`` buffer whose last column swallows the padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagedlm.sample.host_copy import to_device
from pagedlm.sample.row import SamplingRow

TokenHistory = Callable[[Sequence[int], int], tuple[torch.Tensor, torch.Tensor]]
"""``(rows, pad_id) -> (prompt_token_ids [P, Lp], output_token_ids [P, Lo])``: the prompt
and the output tokens so far of the given rows of the batch, int64 on the logits' device,
right-padded with ``pad_id``."""


def token_history_from_lists(
    prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]], device: torch.device
) -> TokenHistory:
    """A ``TokenHistory`` over host lists, one prompt and one output list per batch row."""

    def history(rows: Sequence[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            pad_token_ids([prompts[r] for r in rows], pad_id, device),
            pad_token_ids([outputs[r] for r in rows], pad_id, device),
        )

    return history


@dataclass(frozen=True)
class PenaltyTensors:
    """Penalty inputs for the rows that have any penalty.

    ``row_indices``: ``[P]`` int64 rows of the batch, or ``None`` when every row (P = N) is
    penalized. ``frequency``/``presence``: ``[P]`` float32, or ``None`` when all are 0.
    ``repetition``: ``[P]`` float32, or ``None`` when all are 1. ``output_token_ids``:
    ``[P, max_output_len]`` int64; ``prompt_token_ids``: ``[P, max_prompt_len]`` int64, only
    kept when ``repetition`` is set. Padding is ``vocab_size``.
    """

    row_indices: torch.Tensor | None
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    output_token_ids: torch.Tensor
    prompt_token_ids: torch.Tensor | None
    vocab_size: int

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device,
        token_history: TokenHistory | None,
    ) -> PenaltyTensors | None:
        """Gather the penalized rows; ``None`` when no row has a penalty."""
        penalized = [index for index, row in enumerate(rows) if row.is_penalized]
        if not penalized:
            return None
        if token_history is None:
            raise ValueError("penalized rows need a token_history to read their tokens from.")
        params = [rows[index].params for index in penalized]

        def floats(values: list[float]) -> torch.Tensor:
            return to_device(values, torch.float32, device)

        repetition = [p.repetition_penalty for p in params]
        frequency = [p.frequency_penalty for p in params]
        presence = [p.presence_penalty for p in params]
        has_repetition = any(value != 1.0 for value in repetition)
        has_additive = any(value != 0.0 for value in chain(frequency, presence))
        prompt_ids, output_ids = token_history(penalized, vocab_size)
        return cls(
            row_indices=(
                None if len(penalized) == len(rows) else to_device(penalized, torch.int64, device)
            ),
            repetition=floats(repetition) if has_repetition else None,
            frequency=floats(frequency) if has_additive else None,
            presence=floats(presence) if has_additive else None,
            output_token_ids=output_ids,
            prompt_token_ids=prompt_ids if has_repetition else None,
            vocab_size=vocab_size,
        )


def pad_token_ids(
    token_ids: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> torch.Tensor:
    """Right-pad ragged id lists into ``[len(token_ids), max_len]`` int64 with ``pad_id``.

    One flat ``np.fromiter`` pass and one masked assignment: about 4x faster than
    ``torch.tensor`` on a Python list, which matters because this runs every step.
    """
    lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
    max_len = int(lengths.max()) if len(token_ids) else 0
    padded = np.full((len(token_ids), max_len), pad_id, dtype=np.int64)
    if max_len:
        flat = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
        padded[np.arange(max_len) < lengths[:, None]] = flat
    return torch.from_numpy(padded).to(device)


def _token_counts(token_ids: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[P, L]`` padded ids -> ``[P, vocab_size]`` occurrence counts."""
    counts = torch.zeros((token_ids.shape[0], vocab_size + 1), dtype=dtype, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=dtype))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Apply every penalty in place. ``logits``: ``[N, vocab_size]`` float32."""
    rows = penalties.row_indices
    penalized = logits if rows is None else logits[rows]
    vocab_size = penalties.vocab_size
    output_counts = _token_counts(penalties.output_token_ids, vocab_size, logits.dtype)
    if penalties.repetition is not None:
        assert penalties.prompt_token_ids is not None
        seen = output_counts > 0
        seen |= _token_counts(penalties.prompt_token_ids, vocab_size, logits.dtype) > 0
        factor = penalties.repetition.unsqueeze(1)
        rescaled = torch.where(penalized > 0, penalized / factor, penalized * factor)
        penalized = torch.where(seen, rescaled, penalized)
    if penalties.frequency is not None and penalties.presence is not None:
        penalized = (
            penalized
            - penalties.frequency.unsqueeze(1) * output_counts
            - penalties.presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
        )
    if rows is None:
        logits.copy_(penalized)
    else:
        logits.index_copy_(0, rows, penalized)
