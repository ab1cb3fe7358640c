"""How the front end judges the engine core: alive and progressing, busy, or not.

``CoreLiveness`` keeps the last ``Heartbeat`` the core's heartbeat thread sent (see
``core_heartbeat``) and when it arrived; ``assess`` turns that, the core process's exit
status and the scheduler's last stats into an ``EngineHealth``:

- dead: the process exited, or reported a fatal error;
- unresponsive: no heartbeat for ``heartbeat_timeout_s`` (SIGSTOP, a frozen process);
- stalled: the current step has computed longer than the core allows for its work
  (a hung kernel or deadlock; a long prefill gets a proportionally longer bound);
- busy: alive and progressing, but a full batch of requests is already waiting, or a
  step has been computing for over ``BUSY_STEP_S`` (new requests would wait);
- ok.

``live`` (``/health``) holds for ok and busy; ``ready`` (``/ready``) only for ok.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.engine.messages import Heartbeat

BUSY_STEP_S = 5.0


@dataclass(frozen=True)
class EngineHealth:
    status: str
    """"ok", "busy", "stalled", "unresponsive" or "dead"."""
    reason: str | None
    """Why the engine is not ok, in words an operator can act on; None when ok."""
    num_running: int = 0
    num_waiting: int = 0
    step_running_s: float | None = None
    heartbeat_age_s: float | None = None

    @property
    def live(self) -> bool:
        return self.status in ("ok", "busy")

    @property
    def ready(self) -> bool:
        return self.status == "ok"

    def to_json(self) -> dict:
        return {
            "status": self.status,
            "reason": self.reason,
            "num_requests_running": self.num_running,
            "num_requests_waiting": self.num_waiting,
            "step_running_s": self.step_running_s,
            "heartbeat_age_s": self.heartbeat_age_s,
        }


class CoreLiveness:
    """The latest heartbeat and the rules above. Not thread-safe (the event loop owns it)."""

    def __init__(self, heartbeat_timeout_s: float, busy_num_waiting: int, clock=time.monotonic):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.busy_num_waiting = busy_num_waiting
        self._clock = clock
        self._heartbeat: Heartbeat | None = None
        self._received = clock()
        """The core counts as heard from at start-up (it just sent Ready)."""
        self._confirmed_silence: float | None = None
        """``_received`` when a caller last confirmed the silence (see ``confirm_silence``)."""

    def record(self, heartbeat: Heartbeat) -> None:
        self._heartbeat = heartbeat
        self._received = self._clock()

    def silence_confirmed(self) -> bool:
        """Silent, and already confirmed so since the last heartbeat."""
        return self.is_silent() and self._confirmed_silence == self._received

    def confirm_silence(self) -> None:
        """The caller gave unread heartbeats a chance to arrive and none came: later
        checks need not wait again until a heartbeat arrives."""
        if self.is_silent():
            self._confirmed_silence = self._received

    def heartbeat_age_s(self) -> float:
        return self._clock() - self._received

    def is_silent(self) -> bool:
        return self.heartbeat_age_s() > self.heartbeat_timeout_s

    def assess(self, dead_reason: str | None, stats: SchedulerStats) -> EngineHealth:
        age = self.heartbeat_age_s()
        beat = self._heartbeat
        running = None
        if beat is not None and beat.step_running_s is not None:
            running = beat.step_running_s + age

        def health(status: str, reason: str | None) -> EngineHealth:
            return EngineHealth(
                status, reason, stats.num_running_reqs, stats.num_waiting_reqs, running, age
            )

        if dead_reason is not None:
            return health("dead", dead_reason)
        if age > self.heartbeat_timeout_s:
            return health(
                "unresponsive",
                f"The engine core has sent no heartbeat for {age:.1f} s (limit "
                f"{self.heartbeat_timeout_s:g} s, --engine-heartbeat-timeout-s): its process "
                "is stopped, frozen or starved of CPU.",
            )
        if beat is not None and running is not None and running > beat.step_allowed_s:
            return health(
                "stalled",
                f"One engine step has computed for {running:.0f} s, longer than the "
                f"{beat.step_allowed_s:.0f} s allowed for its at most {beat.step_tokens} tokens "
                "(--engine-iteration-timeout-s): the engine core is hung.",
            )
        if stats.num_waiting_reqs >= self.busy_num_waiting:
            return health(
                "busy",
                f"{stats.num_waiting_reqs} requests are waiting for a place in the batch; "
                "new ones would queue behind them.",
            )
        if running is not None and running > BUSY_STEP_S:
            return health(
                "busy", f"A step has been computing for {running:.0f} s (a long prefill)."
            )
        return health("ok", None)
