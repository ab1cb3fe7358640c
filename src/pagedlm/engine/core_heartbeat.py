"""The engine core's heartbeat: a thread that reports progress while a step computes.

The step loop (the core's main thread) tells a ``StepWatch`` when each step starts and
ends and which requests it holds; a daemon ``Heartbeat`` thread sends a ``Heartbeat``
message every ``HEARTBEAT_INTERVAL_S`` on a socket of its own. The front end thus hears
from a core that is busy in a long step (torch and the grammar compiler release the GIL,
and Python hands it over every few milliseconds otherwise), and hears nothing from one
that is stopped (SIGSTOP), frozen or dead.

Busy or hung: a step may run for ``StepWatch.allowed_s(tokens)`` seconds, where
``tokens`` bounds the tokens the step computes (``InFlightWork``): the iteration timeout
per started 1024 tokens, or ten times the slowest per-token time of a finished step,
whichever is longer. A 7k-token prefill on a slow CPU is progress; a 1-token decode step
that has not returned after a minute is not. Time the process spent stopped (a gap
between the heartbeat thread's own ticks) does not count as step time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterable

import zmq

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.engine.messages import Heartbeat, make_encoder

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
TOKENS_PER_TIMEOUT = 1024
"""A step gets one iteration timeout per started block of this many tokens."""
SLOWEST_RATE_FACTOR = 10.0
"""...and at least this many times the slowest seconds-per-token a finished step took."""
FROZEN_GAP_S = 1.0
"""A heartbeat tick this much later than planned means the process was stopped or starved."""


class InFlightWork:
    """An upper bound on the tokens one ``EngineCore.step()`` call computes, from what the
    core was sent.

    A request computes its whole prompt before its first output token (at most
    ``max_num_batched_tokens`` of it per step), then one token per step. Under
    asynchronous scheduling a call also waits for the step launched by the call before,
    so the bound covers two steps. Preemption recomputes more than this; the timeout's
    floor covers that.
    """

    def __init__(self, max_num_batched_tokens: int, async_scheduling: bool = False) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.steps_per_call = 2 if async_scheduling else 1
        self._prefill: dict[str, int] = {}
        self._decoding: set[str] = set()

    def add(self, request_id: str, num_prompt_tokens: int) -> None:
        self._prefill[request_id] = num_prompt_tokens

    def remove(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._prefill.pop(request_id, None)
            self._decoding.discard(request_id)

    def update(self, outputs: Iterable[EngineCoreOutput]) -> None:
        for output in outputs:
            if output.finished:
                self.remove([output.req_id])
            elif output.new_token_ids and self._prefill.pop(output.req_id, None) is not None:
                self._decoding.add(output.req_id)

    def step_tokens(self) -> int:
        one_step = min(
            self.max_num_batched_tokens, sum(self._prefill.values()) + len(self._decoding)
        )
        return one_step * self.steps_per_call


class StepWatch:
    """When the current step started, how much it may compute, and how long it may take.

    Thread-safe: the step loop calls ``start``/``finish``, the heartbeat thread
    ``snapshot`` and ``discount``.
    """

    def __init__(self, iteration_timeout_s: float, clock=time.monotonic) -> None:
        self.iteration_timeout_s = iteration_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._started: float | None = None
        self._tokens = 0
        self._slowest_s_per_token = 0.0
        self.num_steps = 0

    def allowed_s(self, tokens: int) -> float:
        blocks = max(1, math.ceil(tokens / TOKENS_PER_TIMEOUT))
        learned = SLOWEST_RATE_FACTOR * self._slowest_s_per_token * tokens
        return max(self.iteration_timeout_s * blocks, learned)

    def start(self, tokens: int) -> None:
        with self._lock:
            self._started = self._clock()
            self._tokens = tokens

    def finish(self) -> None:
        with self._lock:
            if self._started is None:
                return
            elapsed = self._clock() - self._started
            if self._tokens:
                rate = elapsed / self._tokens
                self._slowest_s_per_token = max(self._slowest_s_per_token, rate)
            self._started = None
            self.num_steps += 1

    def discount(self, seconds: float) -> None:
        """Do not count ``seconds`` (the process was stopped) against the current step."""
        with self._lock:
            if self._started is not None:
                self._started += seconds

    def snapshot(self) -> Heartbeat:
        with self._lock:
            running = None if self._started is None else self._clock() - self._started
            return Heartbeat(self.num_steps, running, self._tokens, self.allowed_s(self._tokens))


class HeartbeatThread:
    """Sends ``watch.snapshot()`` every ``interval_s`` on its own PUSH socket to
    ``address`` (the front end's output socket; ZMQ sockets are not thread-safe, so it
    never touches the step loop's). A heartbeat the front end has not read is dropped,
    never queued without bound."""

    def __init__(
        self,
        context: zmq.Context,
        address: str,
        watch: StepWatch,
        interval_s: float = HEARTBEAT_INTERVAL_S,
    ) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 16)
        self._socket.connect(address)
        self._watch = watch
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedlm-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self._interval_s + 1)

    def _run(self) -> None:
        encoder = make_encoder()
        planned = time.monotonic()
        try:
            while not self._stop.is_set():
                with contextlib.suppress(zmq.Again):
                    self._socket.send(encoder.encode(self._watch.snapshot()), flags=zmq.NOBLOCK)
                planned += self._interval_s
                self._stop.wait(max(0.0, planned - time.monotonic()))
                late = time.monotonic() - planned
                if late > FROZEN_GAP_S:
                    self._watch.discount(late)
                    planned = time.monotonic()
        except zmq.ZMQError:  # the context is going away with the process
            logger.debug("heartbeat socket closed", exc_info=True)
        finally:
            self._socket.close(linger=0)
