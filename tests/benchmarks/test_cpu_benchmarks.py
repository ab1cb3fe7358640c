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
            calls.append((name, prompts[0][0]))
            return next(rates[name])

        return run

    results = interleaved(
        {"a": engine("a"), "b": engine("b")}, lambda repeat: [[10 + repeat, 2]], repeats=3
    )
    # Each repeat's prompts go to every engine, and no repeat sees an earlier one's prompts.
    assert calls == [("a", 10), ("b", 10), ("a", 11), ("b", 11), ("a", 12), ("b", 12)]
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


def test_throughput_host_phases_time_every_phase(tmp_path, capsys):
    """``bench throughput --host-phases`` on a tiny model: every phase of the engine was
    timed, once per step or more, and the parts fit inside the whole engine step."""
    import json

    from pagedlm.benchmarks import throughput
    from pagedlm.benchmarks.host_overhead import tiny_model

    tiny_model(str(tmp_path), 16384)
    throughput.main(
        ["--model", str(tmp_path), "--num-prompts", "4", "--input-len", "8",
         "--output-len", "6", "--host-phases"]
    )  # fmt: skip
    out = capsys.readouterr().out
    table = json.loads(out[out.index("{", out.index("host phases")) : out.rindex("}") + 1])
    assert table["steps"] >= 6
    whole = table["whole engine step"]
    parts = ["schedule", "execute_model (inputs, forward launch)", "engine metrics",
             "sample_tokens (metadata, sampling launch)", "output processor",
             "collect (the device wait, then update_from_output)"]  # fmt: skip
    assert all(table[name] > 0 for name in parts)
    assert sum(table[name] for name in parts) <= whole <= table["ms_per_step"]
    collect = table["collect (the device wait, then update_from_output)"]
    assert 0 < table["  of which update_from_output"] <= collect
