"""AsyncLLM.health() from the core's heartbeat: a stopped core is noticed and recovers, a
busy one stays live, and a dead one resolves ``wait_until_dead``."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedlm import AsyncLLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.engine.exceptions import EngineDeadError, EngineStalledError

HEARTBEAT_TIMEOUT_S = 1.5


@pytest.fixture()
def engine(tiny_checkpoint):
    args = EngineArgs(
        model=str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        max_model_len=1024,
        engine_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    engine.shutdown()


async def _until(engine, status: str, within_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if (await engine.health()).status == status:
            return time.monotonic() - start
        await asyncio.sleep(0.05)
    raise AssertionError(f"health never became {status!r}: {await engine.health()}")


def test_stopped_core_is_unresponsive_then_recovers_then_death_is_reported(engine):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main():
        stream = engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "busy")
        await stream.__anext__()
        assert (await engine.health()).status == "ok"
        await engine.check_health()

        os.kill(engine.core_pid, signal.SIGSTOP)
        try:
            noticed = await _until(engine, "unresponsive", HEARTBEAT_TIMEOUT_S + 3)
            asked = time.monotonic()
            health = await engine.health()
            assert time.monotonic() - asked < 0.3, "a confirmed silence is answered at once"
            assert not health.live and "no heartbeat" in health.reason
            with pytest.raises(EngineStalledError, match="no heartbeat"):
                await engine.check_health()
            assert not engine.errored  # stopped is not dead: nothing was failed
        finally:
            os.kill(engine.core_pid, signal.SIGCONT)
        recovered = await _until(engine, "ok", 2.0)
        print(f"SIGSTOP noticed after {noticed:.2f} s, recovered {recovered:.2f} s after SIGCONT")
        outputs = [output async for output in stream]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) >= 1

        waiter = asyncio.ensure_future(engine.wait_until_dead())
        await asyncio.sleep(0.1)
        assert not waiter.done()
        os.kill(engine.core_pid, signal.SIGKILL)
        error = await asyncio.wait_for(waiter, 2.0)
        assert isinstance(error, EngineDeadError) and "signal 9" in str(error)
        health = await engine.health()
        assert health.status == "dead" and "signal 9" in health.reason
        with pytest.raises(EngineDeadError):
            await engine.check_health()

    asyncio.run(main())
