"""``AsyncLLM.collective_rpc`` through a real engine-core process (its worker in that
process): the call crosses as msgspec, an extension method and an importable function
answer, a worker's exception comes back as ``WorkerRpcError`` with its rank, what cannot
cross is refused in the front end, and the front end's wait is bounded by the timeout even
though nothing can interrupt the core's own worker."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from pagedlm import AsyncLLM, SamplingParams
from pagedlm.engine import async_llm
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.worker.rpc import WorkerRpcError
from worker_extensions import embedding_shape, rank_plus

TESTS = Path(__file__).resolve().parents[1]
BOUND_S = 60.0


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    args = EngineArgs(
        model=str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        num_kv_blocks=32,
        max_model_len=64,
        worker_extension_cls="worker_extensions:RankProbe",
    )
    with pytest.MonkeyPatch.context() as patch:
        # The engine-core process imports the extension by name: put tests/ on its path.
        path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
        patch.setenv("PYTHONPATH", path)
        engine = AsyncLLM.from_engine_args(args)
    yield engine
    engine.shutdown()


async def _generate(engine: AsyncLLM, request_id: str) -> list[int]:
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 2, 77]}
    outputs = [output async for output in engine.generate(prompt, params, request_id)]
    return list(outputs[-1].outputs[0].token_ids)


def test_calls_answer_through_the_engine_core(engine):
    async def main():
        whoami = await engine.collective_rpc("whoami", BOUND_S, ("a",), {"suffix": "b"})
        by_name = await engine.collective_rpc(rank_plus, BOUND_S, args=(7,))
        model = await engine.collective_rpc("apply_model", BOUND_S, args=(embedding_shape,))
        return whoami, by_name, model

    whoami, by_name, model = asyncio.run(main())
    assert whoami == [{"tag": "ab", "rank": 0, "class": "RankProbeWorker"}]
    assert by_name == [7]
    assert model == [[384, 64]]


def test_errors_come_back_typed_and_the_engine_goes_on(engine):
    async def main():
        expected = await _generate(engine, "before")
        with pytest.raises(WorkerRpcError, match=r"'fail_on' failed on worker rank 0") as info:
            await engine.collective_rpc("fail_on", BOUND_S, args=(0,))
        assert (info.value.rank, info.value.method) == (0, "fail_on")
        with pytest.raises(TypeError, match="no name another process can import"):
            await engine.collective_rpc(lambda worker: 1, BOUND_S)
        with pytest.raises(TypeError, match=r"torch\.Tensor"):
            await engine.collective_rpc("whoami", BOUND_S, args=(torch.ones(1),))
        # The core's own worker returned it; it cannot go on to this process.
        with pytest.raises(TypeError, match=r"torch\.Tensor back"):
            await engine.collective_rpc("hand_back_a_tensor", BOUND_S)
        assert await _generate(engine, "after") == expected

    asyncio.run(main())


def test_the_timeout_bounds_the_front_end_s_wait(engine, monkeypatch):
    monkeypatch.setattr(async_llm, "RPC_ANSWER_GRACE_S", 0.2)

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(TimeoutError, match=r"'nap': the engine core did not answer"):
            await engine.collective_rpc("nap", timeout=0.3, args=(3.0,))
        waited = loop.time() - started
        # The core finishes the nap, then answers the next call.
        assert await engine.collective_rpc("whoami", BOUND_S, args=("later",))
        return waited

    assert asyncio.run(main()) < 2.5
