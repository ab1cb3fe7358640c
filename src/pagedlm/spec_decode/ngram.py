"""Prompt lookup ("ngram"): drafts copied from where the request's last tokens occurred before.

vLLM's rule: find the longest suffix of the request's tokens (prompt and outputs so far),
between ``prompt_lookup_min`` and ``prompt_lookup_max`` tokens long, that also occurs
earlier; at its earliest such occurrence, the tokens that followed are the drafts (as many
as follow, up to the number asked for). No match: no drafts.

It runs on the device over the token table, vectorized over requests and positions
(``[requests, row width]`` comparisons per suffix length), so it needs no host copy of
tokens the host has not seen (asynchronous scheduling).
"""

from __future__ import annotations

import torch

from pagedlm.spec_decode.proposer import ProposalRequests, Proposer, SampledStep
from pagedlm.worker.input_batch import InputBatch


class NgramProposer(Proposer):
    def __init__(self, batch: InputBatch, min_n: int, max_n: int) -> None:
        super().__init__(batch)
        self.min_n = min_n
        self.max_n = max_n

    def propose(
        self, step: SampledStep, requests: ProposalRequests
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = int(requests.num_tokens_host.max())
        rows = self.batch.token_ids[requests.slots_device, :width].to(torch.int64)
        return propose_ngrams(
            rows,
            requests.num_tokens,
            self.min_n,
            self.max_n,
            requests.max_drafts,
            requests.num_drafts_device,
        )


def propose_ngrams(
    rows: torch.Tensor,
    lengths: torch.Tensor,
    min_n: int,
    max_n: int,
    max_drafts: int,
    num_drafts: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows``: ``[m, W]`` int64 tokens, row ``i``'s first ``lengths[i]`` (int64 ``[m]``)
    real; ``num_drafts``: ``[m]`` drafts wanted. Returns ``(drafts [m, max_drafts],
    num_valid [m])``: the tokens after the earliest earlier occurrence of the longest
    matching suffix."""
    num_rows, width = rows.shape
    device = rows.device
    columns = torch.arange(width, device=device)
    run = torch.ones((num_rows, width), dtype=torch.bool, device=device)
    match_len = torch.zeros((num_rows, width), dtype=torch.int64, device=device)
    for back in range(max_n):
        # Does the token ``back`` before each end position equal the one ``back`` before
        # the request's last token?
        index = (lengths - 1 - back).clamp(min=0)
        suffix = rows.gather(1, index[:, None])
        suffix = torch.where((lengths - 1 - back >= 0)[:, None], suffix, -1)
        earlier = torch.cat(
            [torch.full((num_rows, back), -2, dtype=rows.dtype, device=device), rows], dim=1
        )[:, :width]
        run &= earlier == suffix
        match_len += run
    # Only occurrences ending before the last token count (the suffix itself is no match).
    match_len = torch.where(columns[None, :] < (lengths - 1)[:, None], match_len, 0)
    longest = match_len.max(dim=1).values
    end = torch.argmax((match_len == longest[:, None]).to(torch.int8), dim=1)  # earliest
    start = end + 1
    num_valid = torch.minimum(lengths - start, num_drafts)
    num_valid = torch.where(longest >= min_n, num_valid, 0).clamp(min=0)
    offsets = torch.arange(max_drafts, device=device)
    index = (start[:, None] + offsets[None, :]).clamp(max=width - 1)
    return rows.gather(1, index), num_valid
