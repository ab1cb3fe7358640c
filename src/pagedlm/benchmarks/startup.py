"""Start-up time of ``pagedlm serve``: launch to the first completed request.

``python -m pagedlm.benchmarks.startup [--runs 3] [--baseline-src DIR] [--model M]
[-- SERVE FLAGS]`` launches ``pagedlm serve`` (the embedded SmolLM2 and default flags
unless told otherwise) ``runs`` times. Each run sends one completion the moment the process
is started, retrying until the port accepts connections (it is bound before the model
loads, so the request then waits in the listen queue), and stops the server once the
answer is complete. With ``--baseline-src`` (another checkout's ``src``, e.g. from
``git archive``) every run of this tree alternates with one of that tree, so both see the
same machine load. One untimed launch per tree comes first (``--warmup``): it compiles the
tree's bytecode and brings the files into the page cache, as any second start finds them.
It prints one JSON line per run and one with the medians per tree:

- ``first_completion_s``: launch to the last byte of the first answer (wall clock);
- ``cpu_s``: user + system CPU time of the server and its engine-core process up to then.
  On a shared machine the wall clock grows with the other processes' load; the CPU time
  much less, so it is the figure to compare between loaded runs;
- ``load_average``: the 1-minute load average when the run started;
- ``engine_ready_s``: when the server logged that the engine is ready (its own clock).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_READY_LINE = re.compile(r"Engine ready in ([0-9.]+) s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_seconds(pid: int) -> float:
    """User + system time of ``pid`` and of its live descendants (Linux ``/proc``)."""
    total = 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                total += _cpu_seconds(int(child))
    except FileNotFoundError:
        pass  # exited between the listing and the read
    return total


def _first_completion(url: str, deadline: float) -> dict[str, Any]:
    import httpx

    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    while time.monotonic() < deadline:
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        except httpx.TransportError:
            time.sleep(0.02)  # not bound yet
            continue
        response.raise_for_status()
        return response.json()
    raise RuntimeError("no completion within the deadline")


def run_once(
    model: str | None, flags: list[str], src: str | None = None, timeout_s: float = 600
) -> dict[str, Any]:
    """One launch of ``pagedlm serve`` (from the ``src`` tree if given): the figures of the
    module docstring."""
    port = _free_port()
    command = [sys.executable, "-m", "pagedlm.entrypoints.cli.main", "serve"]
    command += [model] if model else []
    command += ["--port", str(port), *flags]
    load_average = os.getloadavg()[0]
    with tempfile.TemporaryFile() as log:
        started = time.monotonic()
        env = dict(os.environ)
        if src is not None:
            env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            answer = _first_completion(f"http://127.0.0.1:{port}", started + timeout_s)
            elapsed = time.monotonic() - started
            cpu_s = _cpu_seconds(process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.seek(0)
        text = log.read().decode(errors="replace")
    ready = _READY_LINE.search(text)
    return {
        "first_completion_s": round(elapsed, 2),
        "cpu_s": round(cpu_s, 2),
        "load_average": round(load_average, 2),
        "engine_ready_s": float(ready.group(1)) if ready else None,
        "text": answer["choices"][0]["text"],
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        key: round(statistics.median(run[key] for run in runs), 2)
        for key in ("first_completion_s", "cpu_s", "load_average")
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="launches (default: %(default)s)")
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    parser.add_argument(
        "--baseline-src", default=None, help="a src directory to alternate with this one"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed launches per tree (default: %(default)s)"
    )
    parser.add_argument("serve_flags", nargs=argparse.REMAINDER, help="after --: serve flags")
    args = parser.parse_args(argv)
    flags = [flag for flag in args.serve_flags if flag != "--"]
    trees = (
        {"this": None}
        if args.baseline_src is None
        else {"baseline": os.path.abspath(args.baseline_src), "this": None}
    )
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    threads = os.environ.get("OMP_NUM_THREADS")
    for _ in range(args.warmup):
        for src in trees.values():
            run_once(args.model, flags, src)
    for index in range(args.runs):
        for name, src in trees.items():
            result = run_once(args.model, flags, src)
            runs[name].append(result)
            print(json.dumps({"tree": name, "run": index, **result}), flush=True)
    for name, tree_runs in runs.items():
        summary = {"tree": name, "median_of": len(tree_runs), "omp_num_threads": threads}
        print(json.dumps({**summary, **_medians(tree_runs)}), flush=True)


if __name__ == "__main__":
    main()
