"""The executor-overhead benchmark's own logic: the flag per workload, what a step costs
more under ``mp``, the alternating order and its table (the runs themselves are stubbed)."""

from __future__ import annotations

import json

import pytest

from pagedlm.benchmarks import executor_overhead as bench


def test_each_workload_picks_the_executor_with_its_own_flag():
    import argparse

    host = argparse.Namespace(engine_args='{"async_scheduling": false}')
    bench.set_backend(bench.WORKLOADS["host"], host, "mp")
    assert json.loads(host.engine_args) == {
        "async_scheduling": False,
        "distributed_executor_backend": "mp",
    }
    w2 = argparse.Namespace(distributed_executor_backend=None)
    bench.set_backend(bench.WORKLOADS["w2"], w2, "uni")
    assert w2.distributed_executor_backend == "uni"


def test_overhead_is_the_longer_step_whichever_way_the_metric_points():
    rate, per_step = bench.WORKLOADS["w2"], bench.WORKLOADS["host"]
    # 100 tok/s against 80: a step takes 25% longer.
    assert bench.step_overhead(rate, [100.0, 90.0, 110.0], [80.0, 70.0, 95.0]) == pytest.approx(
        0.25
    )
    assert bench.step_overhead(per_step, [10.0], [10.3]) == pytest.approx(0.03)
    assert bench.step_overhead(per_step, [10.0], [9.0]) == pytest.approx(-0.1)


def test_rounds_alternate_the_order_and_the_table_has_the_medians(monkeypatch, capsys):
    calls = []
    values = {"uni": iter([10.0, 12.0, 11.0]), "mp": iter([11.0, 13.0, 12.0])}

    def fake_measure(name, backend, extra, timeout_s):
        calls.append((name, backend, tuple(extra)))
        return next(values[backend])

    monkeypatch.setattr(bench, "measure", fake_measure)
    bench.main(["--workloads", "host", "--rounds", "3", "--extra-args", "--output-len 8"])
    assert [backend for _, backend, _ in calls] == ["uni", "mp", "mp", "uni", "uni", "mp"]
    assert all(extra == ("--output-len", "8") for _, _, extra in calls)
    table = capsys.readouterr().out.splitlines()[-1]
    assert table == "| host | ms_per_step | 11.000 | 12.000 | +9.09% | 3 each |"
