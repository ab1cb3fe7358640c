"""What the workers pool for one request of a pooling model (its part of ``PoolingParams``
that reaches them: the front end keeps the rest)."""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_TASKS = ("token_embed", "token_classify")
"""Pooling tasks that give one row per prompt token instead of one vector per prompt."""


@dataclass(frozen=True)
class PoolingSpec:
    """A pooling request's task, as the engine core and the workers need it.

    ``task``: "embed", "classify" or "score" (the model's sequence pooling: one vector
    when the prompt ends) or one of ``TOKEN_TASKS`` (a row per prompt token, gathered chunk
    by chunk; such a request never reads the prefix cache, whose tokens have no hidden
    states in the step). ``step_tag_id`` (STEP pooling): only the rows of the prompt
    positions holding this token.
    """

    task: str
    step_tag_id: int | None = None

    @property
    def token_wise(self) -> bool:
        return self.task in TOKEN_TASKS
