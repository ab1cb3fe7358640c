"""The start-up benchmark's own accounting (the timed figures are never asserted)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pagedlm.benchmarks import startup


def test_cpu_seconds_include_live_children():
    busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\n"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys, time\n"
         f"subprocess.Popen([sys.executable, '-c', {busy!r} + 'time.sleep(30)'])\n"
         "time.sleep(30)"]
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while startup._cpu_seconds(parent.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert startup._cpu_seconds(parent.pid) >= 0.5  # the child's busy half second
    finally:
        parent.kill()
        parent.wait()
    assert startup._cpu_seconds(parent.pid) == 0.0  # gone: nothing to count
    assert startup._cpu_seconds(os.getpid()) > 0


@pytest.mark.slow
def test_one_launch_of_the_embedded_model_reports_its_figures():
    result = startup.run_once(None, [])
    assert result["text"]
    assert 0 < result["first_completion_s"] < 600 and result["cpu_s"] > 0
    assert result["engine_ready_s"] is not None
