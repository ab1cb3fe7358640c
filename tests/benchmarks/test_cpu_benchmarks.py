"""The CPU benchmarks' own logic: interleaving and medians, prompts, exclusive step timing."""

from __future__ import annotations

import importlib
import inspect
import time

from pagedlm.benchmarks.cpu_step_profile import TIMED, StepTimer
from pagedlm.benchmarks.vs_llamacpp import interleaved, random_prompts


def test_engines_run_interleaved_and_report_medians():
    calls = []
    rates = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 2.0, 8.0])}

    def engine(name):
        def run(prompts):
            calls.append(name)
            return next(rates[name])

        return run

    results = interleaved({"a": engine("a"), "b": engine("b")}, [[1, 2]], repeats=3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert results["a"][0] == 3.0 and results["a"][1] == [5.0, 1.0, 3.0]
    assert results["b"][0] == 2.0 and len(results["b"][2]) == 3  # one load average per run


def test_prompts_have_the_asked_lengths_and_avoid_special_ids():
    prompts = random_prompts(1000, [64, 3, 500])
    assert [len(p) for p in prompts] == [64, 3, 500]
    assert all(100 <= t < 900 for p in prompts for t in p)
    assert random_prompts(1000, [8], seed=1) == random_prompts(1000, [8], seed=1)


class Outer:
    def step(self, inner):
        time.sleep(0.02)
        inner.work()
        inner.work()


class Inner:
    def work(self):
        time.sleep(0.01)


def test_step_timer_takes_nested_time_out_of_the_enclosing_row():
    timer = StepTimer()
    original_step, original_work = Outer.step, Inner.work
    try:
        # The outer row's name marks the end of a step, as the engine step does.
        timer.wrap(Outer, "step", "engine step (rest)")
        timer.wrap(Inner, "work", "inner")
        start = time.perf_counter()
        Outer().step(Inner())
        total = time.perf_counter() - start
    finally:
        Outer.step, Inner.work = original_step, original_work
    (step,) = timer.steps
    inner, rest = step["inner"] / 1e9, step["engine step (rest)"] / 1e9
    assert inner >= 0.02 and rest >= 0.02  # two 10 ms sleeps; one 20 ms sleep
    assert rest < total - 0.015  # the inner calls' time is not counted twice
    assert rest + inner <= total


def test_every_timed_method_exists():
    # A renamed method would make the profile fail at start-up (or time nothing).
    for module, owner, method, _ in TIMED:
        inspect.getattr_static(getattr(importlib.import_module(module), owner), method)
