"""Pausing generation (vLLM's ``pause_generation`` / ``resume_generation``), for weight
updates between rollouts without restarting anything.

The front end (``AsyncLLM``) owns the user's view: from the call on, new requests wait in
the front end (neither sent nor failed) until ``resume_generation``; in-flight ones are
handled by the mode, vLLM's:

- "abort" (the default): every unfinished request ends at once with finish reason
  "abort", its final output carrying the tokens it had;
- "wait": the front end waits until every in-flight request has finished, then pauses
  the engine core as "keep" (nothing is left to keep);
- "keep": in-flight requests freeze where they are and continue on resume.

The engine core's side is ``EngineCore.pause(mode)`` with mode "abort" or "keep": it
collects the steps in flight, aborts (or keeps) its requests and schedules nothing until
``resume``. ``clear_cache`` (default True) then forgets every cached prefix, whose keys and
values came from the weights about to be replaced; requests kept through it are preempted
first (vLLM's ``reset_running_requests``) and recompute their KV from their tokens when
resumed, so they continue on the new weights.
"""

from __future__ import annotations

from typing import Literal

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.request import RequestStatus

PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")
CORE_PAUSE_MODES: tuple[str, ...] = ("abort", "keep")
"""The modes the engine core takes (the front end does the waiting of "wait")."""


def check_mode(mode: str, modes: tuple[str, ...] = PAUSE_MODES) -> None:
    if mode not in modes:
        raise ValueError(
            f"pause mode {mode!r} is not one of {list(modes)}: 'abort' ends in-flight "
            "requests, 'wait' lets them finish, 'keep' freezes them until resume."
        )


def aborted_outputs(request_ids: list[str]) -> list[EngineCoreOutput]:
    """The final output of each request a pause ended: no new tokens, finish reason
    "abort"."""
    reason = RequestStatus.FINISHED_ABORTED.finish_reason
    return [EngineCoreOutput(request_id, [], reason) for request_id in request_ids]
