"""Prompt logprobs: the logprob of each prompt token given the ones before it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedlm.core.outputs import LogprobsLists
from pagedlm.sample.logprobs import compute_logprobs


@dataclass(frozen=True)
class PromptLogprobsRows:
    """One request's rows of a step whose next token is a prompt token."""

    req_id: str
    num_logprobs: int
    rows: range
    """Rows of the flattened batch whose next token is a prompt token."""
    target_token_ids: list[int]


def compute_prompt_logprobs(
    logits: torch.Tensor, requests: list[PromptLogprobsRows]
) -> dict[str, LogprobsLists]:
    """``logits``: the rows of ``requests`` concatenated in order, ``[sum(len(rows)), V]``."""
    result: dict[str, LogprobsLists] = {}
    offset = 0
    for p in requests:
        n = len(p.rows)
        targets = torch.tensor(p.target_token_ids, dtype=torch.long, device=logits.device)
        rows = compute_logprobs(logits[offset : offset + n], targets, p.num_logprobs)
        offset += n
        lists = rows.to_lists([p.num_logprobs] * n)
        result[p.req_id] = LogprobsLists(
            token_ids=[t for row in lists for t in row.token_ids],
            logprobs=[lp for row in lists for lp in row.logprobs],
            ranks=[r for row in lists for r in row.ranks],
        )
    return result
