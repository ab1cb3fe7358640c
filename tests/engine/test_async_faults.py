"""AsyncLLM when the engine core dies, and shutting it down."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from pagedlm import AsyncLLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.exceptions import EngineDeadError

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}
LONG = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)


def _start(tiny_checkpoint) -> AsyncLLM:
    args = EngineArgs(
        model=str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        max_model_len=1024,
    )
    return AsyncLLM.from_engine_args(args)


def _core_children() -> set[int]:
    """Live (non-zombie) engine-core processes that are children of this process."""
    pids = set()
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        with open(f"/proc/{os.getpid()}/task/{task}/children") as children:
            pids.update(int(pid) for pid in children.read().split())
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                if b"pagedlm.engine.core_proc" in cmdline.read() and not _gone_or_zombie(pid):
                    found.add(pid)
        except FileNotFoundError:
            pass
    return found


def _assert_reaped(pid: int) -> None:
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # not our child any more: already reaped
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_killed_core_fails_every_waiter_promptly(tiny_checkpoint):
    engine = _start(tiny_checkpoint)
    pid = engine.core_pid

    async def main():
        streams = [engine.generate(PROMPT, LONG, f"r{i}") for i in range(3)]
        for stream in streams:
            first = await stream.__anext__()
            assert not first.finished
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        async def drain(stream):
            with pytest.raises(EngineDeadError, match="signal 9"):
                async for _ in stream:
                    pass

        await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), timeout=5)
        assert time.monotonic() - killed_at < 5
        assert engine.errored
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.get_scheduler_stats()
        with pytest.raises(EngineDeadError):
            await engine.generate(PROMPT, LONG, "late").__anext__()
        await engine.abort("r0")  # harmless on a dead engine

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    _assert_reaped(pid)


def _traceback_length(error: BaseException) -> int:
    length, entry = 0, error.__traceback__
    while entry is not None:
        length, entry = length + 1, entry.tb_next
    return length


def test_each_caller_of_a_dead_engine_gets_an_error_of_its_own(tiny_checkpoint):
    """Every waiter, and every later call, raised the one EngineDeadError instance: each
    raise grew its traceback by the caller's frames (100 frames after 20 requests in
    flight, 1,100 after 200 more calls), keeping every failed request's frames and locals
    alive for as long as the engine object lived, and making a logged stack quadratic."""
    engine = _start(tiny_checkpoint)

    async def main():
        streams = [engine.generate(PROMPT, LONG, f"r{i}") for i in range(8)]
        for stream in streams:
            await stream.__anext__()
        os.kill(engine.core_pid, signal.SIGKILL)

        async def drain(stream):
            async for _ in stream:
                pass

        errors = await asyncio.gather(*(drain(s) for s in streams), return_exceptions=True)
        for _ in range(20):
            with pytest.raises(EngineDeadError) as late:
                await engine.generate(PROMPT, LONG, "late").__anext__()
            errors.append(late.value)
            with pytest.raises(EngineDeadError) as call:
                await engine.get_scheduler_stats()
            errors.append(call.value)
        assert all(isinstance(error, EngineDeadError) for error in errors), errors
        assert all("signal 9" in str(error) for error in errors)
        assert len({id(error) for error in errors}) == len(errors)
        assert max(_traceback_length(error) for error in errors) < 20

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_core_killed_while_idle_is_noticed_by_check_health(tiny_checkpoint):
    engine = _start(tiny_checkpoint)
    try:

        async def main():
            await engine.check_health()
            os.kill(engine.core_pid, signal.SIGKILL)
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    await engine.check_health()
                except EngineDeadError:
                    return
                await asyncio.sleep(0.05)
            pytest.fail("check_health kept passing after the core was killed")

        asyncio.run(main())
        assert engine.errored
    finally:
        engine.shutdown()


def test_shutdown_leaves_no_child_and_is_idempotent(tiny_checkpoint):
    engine = _start(tiny_checkpoint)
    pid = engine.core_pid
    ipc_dir = engine._client._ipc_dir
    assert os.stat(ipc_dir).st_mode & 0o777 == 0o700

    async def main():
        stream = engine.generate(PROMPT, LONG, "in-flight")
        await stream.__anext__()
        engine.shutdown()
        with pytest.raises(EngineDeadError, match="shut down"):
            await stream.__anext__()

    asyncio.run(main())
    engine.shutdown()
    _assert_reaped(pid)
    assert pid not in _core_children()
    assert not os.path.exists(ipc_dir)
    with pytest.raises(EngineDeadError):
        asyncio.run(engine.check_health())


def test_startup_failure_reports_the_core_error(tiny_checkpoint, tmp_path):
    # The front end only reads config.json; the core fails loading the corrupt weights, and
    # its traceback must reach the caller with no process left behind.
    shutil.copy(tiny_checkpoint("llama") / "config.json", tmp_path / "config.json")
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=8)
    before = _core_children()
    with pytest.raises(RuntimeError, match="engine core failed to start"):
        AsyncLLM.from_engine_args(args)
    assert _core_children() == before


_SCRIPT = """
import os, signal, sys
from pagedlm import AsyncLLM
from pagedlm.engine.arg_utils import EngineArgs
args = EngineArgs(model=sys.argv[1], skip_tokenizer_init=True, num_kv_blocks=8)
engine = AsyncLLM.from_engine_args(args)
print(engine.core_pid, flush=True)
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _gone_or_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exit", "kill"])
def test_core_does_not_outlive_the_front_end(tiny_checkpoint, how):
    """A normal exit shuts the core down (atexit); a killed front end orphans the core,
    which notices and exits on its own."""
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tiny_checkpoint("llama")), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    pid = int(result.stdout.split()[0])
    if how == "exit":
        assert result.returncode == 0, result.stderr
        assert _gone_or_zombie(pid)
        return
    deadline = time.monotonic() + 10
    while not _gone_or_zombie(pid):
        assert time.monotonic() < deadline, "the orphaned engine core is still running"
        time.sleep(0.1)
