"""Prompt logprobs: the logprob of each prompt token given the ones before it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptLogprobRows:
    """One request's rows of a step whose next token is a prompt token.

    The step computes logits for them after its sampled rows, in request order; their
    targets are the prompt tokens one position later.
    """

    req_id: str
    num_logprobs: int
    num_rows: int
