"""Logprobs of chosen tokens plus the top-k alternatives, as tensors and as Python lists.

By default logprobs are *raw*: ``log_softmax`` of the model's logits before logit bias,
penalties, temperature or any filter (vLLM's default ``raw_logprobs``); the engine's
``logprobs_mode`` may report sampled tokens' from the processed logits, or logits instead
(``LOGPROBS_MODES``). The same function serves sampled tokens (one row per request) and
prompt logprobs (one row per prompt position, ``token_ids`` = the next prompt token;
always raw logprobs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from pagedlm.step import LogprobsLists

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
"""vLLM's names: raw = the model's logits (after a grammar's mask); processed = what the
token was sampled from (logit bias, penalties, temperature, filters applied)."""


def check_logprobs_mode(mode: str) -> None:
    if mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={mode!r} is unknown; use one of {list(LOGPROBS_MODES)}.")


class LogprobsTensors(NamedTuple):
    """Logprobs for ``N`` positions, kept on the device until :meth:`to_lists`.

    ``token_ids``: ``[N, k + 1]`` int64, the chosen/actual token first, then the top-k
    by descending logprob. ``logprobs``: ``[N, k + 1]`` float32, matching ``token_ids``.
    ``ranks``: ``[N]`` int64, the chosen token's rank: 1 + the number of tokens with a
    strictly larger logprob, so a token tied for the top has rank 1.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def to_lists(self, num_logprobs: Sequence[int] | None = None) -> list[LogprobsLists]:
        """One :class:`LogprobsLists` per row, each holding that row as its one position.

        ``num_logprobs[i]`` trims row i to the chosen token plus its first
        ``num_logprobs[i]`` alternatives; ``None`` keeps all ``k``. Copies to the host once.
        """
        num_rows, width = self.token_ids.shape
        if num_logprobs is not None and len(num_logprobs) != num_rows:
            raise ValueError(
                f"num_logprobs has {len(num_logprobs)} entries for {num_rows} rows; "
                "pass one count per row."
            )
        token_ids = self.token_ids.tolist()
        logprobs = self.logprobs.tolist()
        ranks = self.ranks.tolist()
        result = []
        for row in range(num_rows):
            keep = width if num_logprobs is None else 1 + num_logprobs[row]
            if not 1 <= keep <= width:
                raise ValueError(
                    f"row {row} asks for {keep - 1} logprobs but only {width - 1} were "
                    "computed; compute with num_top = the largest count requested."
                )
            result.append(
                LogprobsLists(
                    token_ids=[token_ids[row][:keep]],
                    logprobs=[logprobs[row][:keep]],
                    ranks=[ranks[row]],
                )
            )
        return result

    def to_position_lists(self, num_logprobs: int | None = None) -> LogprobsLists:
        """All rows as consecutive positions of ONE request (prompt logprobs).

        ``num_logprobs`` trims every position to the actual token plus that many
        alternatives; ``None`` keeps all ``k``.
        """
        width = self.token_ids.shape[1]
        keep = width if num_logprobs is None else 1 + num_logprobs
        if not 1 <= keep <= width:
            raise ValueError(
                f"asked for {keep - 1} logprobs but only {width - 1} were computed; "
                "compute with num_top >= the count requested."
            )
        return LogprobsLists(
            token_ids=self.token_ids[:, :keep].tolist(),
            logprobs=self.logprobs[:, :keep].tolist(),
            ranks=self.ranks.tolist(),
        )


def compute_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, as_logits: bool = False
) -> LogprobsTensors:
    """Logprobs of ``token_ids`` and the ``num_top`` most likely tokens under ``logits``.

    ``logits``: ``[N, vocab]`` (any float dtype; computed in float32). ``token_ids``: ``[N]``
    int64. ``num_top``: 0 for the chosen token alone. ``as_logits``: report the logits
    themselves (same tokens and ranks). Among exactly tied logprobs the order of the top-k
    entries is whatever ``torch.topk`` returns.
    """
    if not 0 <= num_top <= logits.shape[-1]:
        raise ValueError(
            f"num_top={num_top} must be between 0 and the vocabulary size {logits.shape[-1]}."
        )
    logprobs = logits.float() if as_logits else torch.log_softmax(logits.float(), dim=-1)
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen_logprobs = logprobs.gather(1, token_ids)
    ranks = (logprobs > chosen_logprobs).sum(dim=-1) + 1
    if num_top == 0:
        return LogprobsTensors(token_ids, chosen_logprobs, ranks)
    top_logprobs, top_token_ids = logprobs.topk(num_top, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_token_ids], dim=1),
        logprobs=torch.cat([chosen_logprobs, top_logprobs], dim=1),
        ranks=ranks,
    )
