"""Per-(row, token) logit edits: ``logit_bias``, ``allowed_token_ids``, ``bad_words`` and
the ``min_tokens`` stop mask.

The bias and the masks touch a handful of (row, token) pairs out of
``[num_rows, vocab_size]``, so they are stored as coordinate lists and applied with one
``index_put_`` each. ``allowed_token_ids`` keeps a few tokens of a row and masks the rest:
a dense keep mask over the restricted rows only, built once with the metadata. A bad word
of one token is always masked; one of several tokens masks its last token where the
output so far ends with the others, compared on the device against the batch's
``TokenHistory`` (so the tokens of the step in flight count without the host seeing them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedlm.sample.host_copy import to_device
from pagedlm.sample.penalties import TokenHistory
from pagedlm.sample.row import SamplingRow


@dataclass(frozen=True)
class LogitAdjustments:
    """Coordinates of the sparse edits for one batch.

    ``bias_rows``/``bias_token_ids``/``bias_values``: ``[num_bias]`` each; the value is added.
    ``masked_rows``/``masked_token_ids``: ``[num_masked]`` each; the logit becomes ``-inf``.
    ``allowed_rows`` ``[R]`` and ``allowed_mask`` ``[R, vocab_size]`` (bool): the rows with
    ``allowed_token_ids`` keep only the tokens their mask row marks; None when no row has
    them. Invariant: every token id is in ``[0, vocab_size)``; any list may be empty.
    """

    bias_rows: torch.Tensor
    bias_token_ids: torch.Tensor
    bias_values: torch.Tensor
    masked_rows: torch.Tensor
    masked_token_ids: torch.Tensor
    allowed_rows: torch.Tensor | None = None
    allowed_mask: torch.Tensor | None = None
    banned_rows: torch.Tensor | None = None
    banned_token_ids: torch.Tensor | None = None
    banned_if: torch.Tensor | None = None
    """Bad words of several tokens: ``[B]`` each; the logit of (row, token) becomes
    ``-inf`` where ``banned_if`` (bool, computed from the row's output so far) holds."""
    stop_rows: torch.Tensor | None = None
    stop_token_ids: torch.Tensor | None = None
    stop_row_set: torch.Tensor | None = None
    stop_row_at: torch.Tensor | None = None
    """The ``min_tokens`` mask of rows with a grammar: ``stop_rows``/``stop_token_ids``
    ``[S]`` each; the stop token's logit becomes ``-inf`` unless the row allows nothing
    else (a grammar that has ended allows only its stop tokens: the grammar wins over
    ``min_tokens``). ``stop_row_set`` ``[U]``: those rows once each, and ``stop_row_at``
    ``[S]``: each entry's place in it, so the check reads each row once. Rows without a
    grammar always have another token left: their stops are in ``masked_rows``."""

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device,
        token_history: TokenHistory | None = None,
    ) -> LogitAdjustments | None:
        """Collect the edits of every row; ``None`` when no row has any. ``token_history``
        is read only for bad words of several tokens."""
        bias_rows: list[int] = []
        bias_token_ids: list[int] = []
        bias_values: list[float] = []
        masked_rows: list[int] = []
        masked_token_ids: list[int] = []
        stop_rows: list[int] = []
        stop_token_ids: list[int] = []
        allowed_rows: list[int] = []
        allowed_at: list[int] = []
        allowed_token_ids: list[int] = []
        for row_index, row in enumerate(rows):
            params = row.params
            if params.allowed_token_ids is not None:
                allowed_at.extend([len(allowed_rows)] * len(params.allowed_token_ids))
                allowed_rows.append(row_index)
                allowed_token_ids.extend(params.allowed_token_ids)
            for token_id, value in (params.logit_bias or {}).items():
                if not 0 <= token_id < vocab_size:
                    raise ValueError(
                        f"logit_bias names token id {token_id}, outside the model's vocabulary "
                        f"[0, {vocab_size}); remove it from logit_bias."
                    )
                bias_rows.append(row_index)
                bias_token_ids.append(token_id)
                bias_values.append(value)
            for ids in params.bad_words_token_ids:
                if len(ids) == 1 and 0 <= ids[0] < vocab_size:  # else it cannot be sampled
                    masked_rows.append(row_index)
                    masked_token_ids.append(ids[0])
            if row.num_output_tokens < params.min_tokens:
                # Only a grammar can leave a row nothing but its stop tokens (requests
                # whose allowed_token_ids or bad words would are refused when added).
                guarded = params.structured_outputs is not None
                rows_to, ids_to = (
                    (stop_rows, stop_token_ids) if guarded else (masked_rows, masked_token_ids)
                )
                for token_id in params.all_stop_token_ids:
                    # An id the LM head cannot produce can never be sampled: nothing to mask.
                    if 0 <= token_id < vocab_size:
                        rows_to.append(row_index)
                        ids_to.append(token_id)
        banned = _multi_token_bad_words(rows, vocab_size, device, token_history)
        if not (bias_rows or masked_rows or stop_rows or allowed_rows or banned):
            return None

        def as_index(values: list[int]) -> torch.Tensor:
            return to_device(values, torch.int64, device)

        allowed_mask = None
        if allowed_rows:
            if not all(0 <= t < vocab_size for t in allowed_token_ids):
                raise ValueError(
                    f"allowed_token_ids names a token id outside the model's vocabulary "
                    f"[0, {vocab_size}); remove it."
                )
            allowed_mask = torch.zeros(
                len(allowed_rows), vocab_size, dtype=torch.bool, device=device
            )
            allowed_mask[as_index(allowed_at), as_index(allowed_token_ids)] = True
        return cls(
            bias_rows=as_index(bias_rows),
            bias_token_ids=as_index(bias_token_ids),
            bias_values=to_device(bias_values, torch.float32, device),
            masked_rows=as_index(masked_rows),
            masked_token_ids=as_index(masked_token_ids),
            allowed_rows=as_index(allowed_rows) if allowed_rows else None,
            allowed_mask=allowed_mask,
            **(_stop_rows(stop_rows, stop_token_ids, as_index) if stop_rows else {}),
            **(banned or {}),
        )


def _multi_token_bad_words(
    rows: Sequence[SamplingRow],
    vocab_size: int,
    device: torch.device,
    token_history: TokenHistory | None,
) -> dict[str, torch.Tensor] | None:
    """``banned_rows``/``banned_token_ids``/``banned_if`` for the bad words of several
    tokens whose prefix fits in the row's output so far; None when there are none."""
    entries = [
        (index, ids)
        for index, row in enumerate(rows)
        for ids in row.params.bad_words_token_ids
        if 1 < len(ids) <= row.num_output_tokens + 1 and 0 <= ids[-1] < vocab_size
    ]
    if not entries:
        return None
    if token_history is None:
        raise ValueError("bad words of several tokens need the batch's token history.")
    history_rows = sorted({index for index, _ in entries})
    _, outputs = token_history(history_rows, vocab_size)
    at = {row: position for position, row in enumerate(history_rows)}
    # One comparison per prefix token: (history row, column, expected id, entry).
    gather_rows, gather_cols, expected, owner = [], [], [], []
    for entry, (index, ids) in enumerate(entries):
        prefix = ids[:-1]
        start = rows[index].num_output_tokens - len(prefix)
        gather_rows += [at[index]] * len(prefix)
        gather_cols += range(start, start + len(prefix))
        expected += prefix
        owner += [entry] * len(prefix)
    seen = outputs[
        to_device(gather_rows, torch.int64, device), to_device(gather_cols, torch.int64, device)
    ]
    differs = (seen != to_device(expected, torch.int64, device)).to(torch.int32)
    mismatches = torch.zeros(len(entries), dtype=torch.int32, device=device)
    mismatches.index_add_(0, to_device(owner, torch.int64, device), differs)
    return {
        "banned_rows": to_device([index for index, _ in entries], torch.int64, device),
        "banned_token_ids": to_device([ids[-1] for _, ids in entries], torch.int64, device),
        "banned_if": mismatches == 0,
    }


def _stop_rows(
    rows: list[int], token_ids: list[int], as_index: Callable[[list[int]], torch.Tensor]
) -> dict[str, torch.Tensor]:
    row_set = sorted(set(rows))
    place = {row: i for i, row in enumerate(row_set)}
    return dict(
        stop_rows=as_index(rows),
        stop_token_ids=as_index(token_ids),
        stop_row_set=as_index(row_set),
        stop_row_at=as_index([place[row] for row in rows]),
    )


def apply_logit_adjustments(logits: torch.Tensor, adjustments: LogitAdjustments) -> None:
    """Add the biases, keep only the allowed tokens, mask the bad words, then mask the
    stop tokens, in place. ``logits``: ``[num_rows, vocab]``.

    The masks are written after the bias (not accumulated) so that a stop token stays
    unsamplable under ``min_tokens``, and a token outside ``allowed_token_ids`` always,
    whatever bias the request put on it. The one exception: ``min_tokens`` does not
    mask a row's stop tokens when nothing else is left to sample, which happens only where
    the grammar mask (applied before) allows nothing but them: the grammar has ended, and
    masking its stop tokens too would make the row sample a token the grammar forbids.
    """
    if adjustments.bias_rows.numel():
        logits.index_put_(
            (adjustments.bias_rows, adjustments.bias_token_ids),
            adjustments.bias_values,
            accumulate=True,
        )
    if adjustments.allowed_rows is not None:
        assert adjustments.allowed_mask is not None
        rows = logits.index_select(0, adjustments.allowed_rows)
        rows.masked_fill_(~adjustments.allowed_mask, float("-inf"))
        logits.index_copy_(0, adjustments.allowed_rows, rows)
    if adjustments.banned_rows is not None:
        assert adjustments.banned_token_ids is not None and adjustments.banned_if is not None
        # Added, not written: of two entries on one (row, token), either may ban it.
        penalty = torch.where(adjustments.banned_if, float("-inf"), 0.0).to(logits.dtype)
        logits.index_put_(
            (adjustments.banned_rows, adjustments.banned_token_ids), penalty, accumulate=True
        )
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if adjustments.masked_rows.numel():
        logits.index_put_((adjustments.masked_rows, adjustments.masked_token_ids), minus_inf)
    if adjustments.stop_rows is not None:
        assert adjustments.stop_token_ids is not None
        assert adjustments.stop_row_set is not None and adjustments.stop_row_at is not None
        coordinates = (adjustments.stop_rows, adjustments.stop_token_ids)
        unmasked = logits[coordinates]
        logits.index_put_(coordinates, minus_inf)
        # Decided on the device (no sync): rows left with no finite logit keep their stops.
        rows = logits.index_select(0, adjustments.stop_row_set)
        nothing_left = torch.isneginf(rows).all(dim=-1)[adjustments.stop_row_at]
        logits.index_put_(coordinates, torch.where(nothing_left, unmasked, minus_inf))
