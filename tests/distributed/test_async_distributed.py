"""AsyncLLM (the engine core in its own process) over worker processes: a killed worker
fails every stream within 2 s, health checks fail and no process stays behind; two
data-parallel replicas serve one front end."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from parity import processes_gone

from pagedlm import AsyncLLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.exceptions import EngineDeadError

pytestmark = pytest.mark.slow  # an engine-core process plus two workers start per test

LONG = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as children:
            found += [int(child) for child in children.read().split()]
    return found


def _engine(llama, **parallel) -> AsyncLLM:
    args = EngineArgs(
        model=str(llama),
        skip_tokenizer_init=True,
        num_kv_blocks=600,
        max_model_len=1024,
        **parallel,
    )
    return AsyncLLM.from_engine_args(args)


def test_killed_worker_fails_every_stream(llama):
    engine = _engine(llama, tensor_parallel_size=2)
    workers = _children(engine.core_pid)
    assert len(workers) == 2
    failures: list[float] = []

    async def consume(index: int, started: asyncio.Event) -> None:
        try:
            async for _ in engine.generate({"prompt_token_ids": [3, 4, index]}, LONG, f"r{index}"):
                started.set()
        except EngineDeadError:
            failures.append(time.monotonic())

    async def main() -> float:
        started = asyncio.Event()
        tasks = [asyncio.create_task(consume(i, started)) for i in range(4)]
        await asyncio.wait_for(started.wait(), 60)
        killed_at = time.monotonic()
        os.kill(workers[1], signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return killed_at

    try:
        killed_at = asyncio.run(main())
        assert len(failures) == 4
        assert max(failures) - killed_at < 2.0
        # What the server's /health answers from: 503 once the engine is dead.
        assert engine.errored
        with pytest.raises(EngineDeadError):
            asyncio.run(engine.check_health())
    finally:
        core = engine.core_pid
        engine.shutdown()
    deadline = time.monotonic() + 10
    while not processes_gone([core, *workers]):
        assert time.monotonic() < deadline, "a process stayed behind"
        time.sleep(0.05)


def test_two_data_parallel_replicas_behind_one_front_end(llama):
    engine = _engine(llama, data_parallel_size=2)

    async def main() -> list[list[int]]:
        async def one(i: int) -> list[int]:
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            final = None
            async for output in engine.generate({"prompt_token_ids": [5, 6, i]}, params, f"d{i}"):
                final = output
            return final.outputs[0].token_ids

        return await asyncio.gather(*(one(i) for i in range(4)))

    try:
        tokens = asyncio.run(main())
        assert all(len(t) == 6 for t in tokens)
        # Same prompt, same greedy tokens, whichever replica ran it.
        assert asyncio.run(_rerun(engine)) == tokens[0]
    finally:
        engine.shutdown()


async def _rerun(engine: AsyncLLM) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    final = None
    async for output in engine.generate({"prompt_token_ids": [5, 6, 0]}, params, "again"):
        final = output
    return final.outputs[0].token_ids
