"""Busy versus hung: the core's step watch and heartbeat, and the front end's judgement."""

from __future__ import annotations

import time

import pytest
import zmq

from pagedlm.core.outputs import EngineCoreOutput
from pagedlm.core.scheduler_interface import SchedulerStats
from pagedlm.engine.core_heartbeat import HeartbeatThread, InFlightWork, StepWatch
from pagedlm.engine.health import BUSY_STEP_S, CoreLiveness
from pagedlm.engine.messages import Heartbeat, make_core_decoder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _stats(running: int = 0, waiting: int = 0) -> SchedulerStats:
    return SchedulerStats(running, waiting, 0.0, 0, 0, 0)


def test_in_flight_work_bounds_the_next_step():
    work = InFlightWork(max_num_batched_tokens=8192)
    assert work.step_tokens() == 0
    work.add("long", 7500)
    work.add("short", 20)
    assert work.step_tokens() == 7520
    work.add("huge", 20000)
    assert work.step_tokens() == 8192  # one step never computes more than the budget
    work.update([EngineCoreOutput("long", [5]), EngineCoreOutput("short", [], None)])
    assert work.step_tokens() == 8192
    work.remove(["huge"])
    assert work.step_tokens() == 20 + 1  # "short" still prefills, "long" decodes
    work.update([EngineCoreOutput("short", [7])])
    assert work.step_tokens() == 2
    work.update([EngineCoreOutput("short", [8], finish_reason="stop")])
    assert work.step_tokens() == 1
    in_flight = InFlightWork(max_num_batched_tokens=8192, async_scheduling=True)
    in_flight.add("a", 100)
    assert in_flight.step_tokens() == 200  # a call also finishes the step before


def test_step_allowance_scales_with_work_and_learns_slow_steps():
    clock = Clock()
    watch = StepWatch(iteration_timeout_s=60.0, clock=clock)
    assert watch.allowed_s(1) == 60.0
    assert watch.allowed_s(1024) == 60.0
    assert watch.allowed_s(7500) == 60.0 * 8  # one timeout per started 1024 tokens
    watch.start(100)
    clock.now += 50.0  # 0.5 s per token: a very slow machine
    watch.finish()
    assert watch.num_steps == 1
    assert watch.allowed_s(7500) == pytest.approx(10 * 0.5 * 7500)
    assert watch.allowed_s(1) == 60.0


def test_snapshot_reports_the_running_step_minus_stopped_time():
    clock = Clock()
    watch = StepWatch(iteration_timeout_s=30.0, clock=clock)
    idle = watch.snapshot()
    assert idle.step_running_s is None and idle.num_steps == 0
    watch.start(2048)
    clock.now += 25.0
    watch.discount(20.0)  # the process was stopped for 20 of those seconds
    beat = watch.snapshot()
    assert beat.step_running_s == pytest.approx(5.0)
    assert (beat.step_tokens, beat.step_allowed_s) == (2048, 60.0)


def _liveness(clock: Clock, timeout_s: float = 5.0) -> CoreLiveness:
    return CoreLiveness(timeout_s, busy_num_waiting=8, clock=clock)


def test_long_step_within_its_allowance_is_busy_not_hung():
    clock = Clock()
    liveness = _liveness(clock)
    liveness.record(Heartbeat(3, step_running_s=50.0, step_tokens=7500, step_allowed_s=480.0))
    health = liveness.assess(None, _stats(running=1))
    assert (health.status, health.live, health.ready) == ("busy", True, False)
    assert "long prefill" in health.reason
    assert health.step_running_s == pytest.approx(50.0)


def test_step_past_its_allowance_is_stalled():
    clock = Clock()
    liveness = _liveness(clock)
    liveness.record(Heartbeat(3, step_running_s=59.0, step_tokens=4, step_allowed_s=60.0))
    assert liveness.assess(None, _stats()).status == "busy"
    clock.now += 2.0  # no newer heartbeat yet: the step has run 61 s by now
    liveness.record(Heartbeat(3, step_running_s=61.5, step_tokens=4, step_allowed_s=60.0))
    health = liveness.assess(None, _stats())
    assert (health.status, health.live) == ("stalled", False)
    assert "60 s allowed" in health.reason and "--engine-iteration-timeout-s" in health.reason


def test_silence_is_unresponsive_and_a_new_heartbeat_recovers():
    clock = Clock()
    liveness = _liveness(clock, timeout_s=5.0)
    liveness.record(Heartbeat(1, None, 0, 60.0))
    clock.now += 4.9
    assert liveness.assess(None, _stats()).status == "ok"
    clock.now += 0.2
    health = liveness.assess(None, _stats())
    assert (health.status, health.live) == ("unresponsive", False)
    assert "no heartbeat for 5.1 s" in health.reason
    assert not liveness.silence_confirmed()
    liveness.confirm_silence()
    assert liveness.silence_confirmed()
    liveness.record(Heartbeat(1, None, 0, 60.0))
    assert liveness.assess(None, _stats()).status == "ok"
    assert not liveness.silence_confirmed()
    clock.now += 5.1  # a new silence must be confirmed anew
    assert liveness.is_silent() and not liveness.silence_confirmed()


def test_dead_wins_and_a_full_queue_is_busy():
    clock = Clock()
    liveness = _liveness(clock)
    dead = liveness.assess("killed by signal 9", _stats())
    assert (dead.status, dead.reason, dead.live) == ("dead", "killed by signal 9", False)
    busy = liveness.assess(None, _stats(running=8, waiting=8))
    assert (busy.status, busy.live, busy.ready) == ("busy", True, False)
    assert busy.to_json()["num_requests_waiting"] == 8
    ok = liveness.assess(None, _stats(running=8, waiting=7))
    assert (ok.status, ok.ready, ok.reason) == ("ok", True, None)
    liveness.record(Heartbeat(1, BUSY_STEP_S - 1, 100, 60.0))
    assert liveness.assess(None, _stats()).status == "ok"


def test_heartbeat_thread_beats_while_the_main_thread_is_in_a_step(tmp_path):
    context = zmq.Context()
    address = f"ipc://{tmp_path}/out"
    receiver = context.socket(zmq.PULL)
    receiver.bind(address)
    watch = StepWatch(iteration_timeout_s=60.0)
    heartbeat = HeartbeatThread(context, address, watch, interval_s=0.05)
    heartbeat.start()
    try:
        watch.start(1000)
        time.sleep(0.3)  # a "step" that holds the main thread
        decoder = make_core_decoder()
        beats = []
        while receiver.poll(0) and len(beats) < 100:
            beats.append(decoder.decode(receiver.recv()))
        assert len(beats) >= 3
        assert all(isinstance(beat, Heartbeat) for beat in beats)
        assert beats[-1].step_running_s > 0.1 and beats[-1].step_tokens == 1000
    finally:
        heartbeat.stop()
        receiver.close(linger=0)
        context.destroy(linger=0)
