"""What the engine core reports to the front end about each request, once per step."""

from __future__ import annotations

from dataclasses import dataclass

from pagedlm.step import LogprobsLists


@dataclass(frozen=True)
class EngineCoreOutput:
    """What happened to one request in one step, as reported to the front end."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    num_cached_tokens: int = 0
    queued_seconds: float | None = None
    """Seconds from arrival to first scheduling (None until the request was scheduled)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
