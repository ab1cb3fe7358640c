"""vLLM's ``pause_generation`` / ``resume_generation`` / ``is_paused`` on CPU: in-flight
requests end with finish reason "abort", finish first ("wait") or freeze and continue
("keep"), new requests wait in the front end until resumed (neither sent nor failed), the
prefix cache is cleared, and weights may be replaced meanwhile. The engine core's side
in process (``EngineCore.pause``), then ``AsyncLLM`` against its engine-core process, with
every wait bounded."""

from __future__ import annotations

import asyncio
import warnings

import pytest

from pagedlm import LLM, AsyncLLM, RequestOutputKind, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs

PROMPT = {"prompt_token_ids": list(range(5, 45))}  # 40 tokens: two full blocks of 16
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
WAIT_S = 60.0
"""The most any awaited step of these tests may take on a loaded 2-core machine."""


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


# ---------------------------------------------------------------------- the engine core


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_core_pause_abort_and_keep(model, async_scheduling):
    llm = LLM(model, skip_tokenizer_init=True, num_kv_blocks=64, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    core = engine.engine_core
    try:
        expected = llm.generate([PROMPT], SHORT, use_tqdm=False)[0].outputs[0].token_ids
        engine.add_request("a", PROMPT, LONG)
        engine.add_request("b", PROMPT, LONG)
        for _ in range(3):
            engine.step()
        outputs = core.pause("abort")
        finished = {o.req_id: o.finish_reason for o in outputs if o.finished}
        assert finished == {"a": "abort", "b": "abort"}
        engine.output_processor.process_outputs(outputs)  # what AsyncLLM's front end does
        assert core.paused and not core.has_work() and core.step() == []
        assert core.make_stats().kv_cache_usage == 0.0
        with pytest.raises(ValueError, match=r"paused; resume_generation\(\)"):
            engine.add_request("c", PROMPT, SHORT)
        core.resume()

        engine.add_request("kept", PROMPT, SHORT)
        for _ in range(3):
            engine.step()
        stats_before = core.make_stats()
        outputs = core.pause("keep", clear_cache=True)  # with the step in flight's tokens
        assert not any(o.finished for o in outputs)
        engine.output_processor.process_outputs(outputs)
        stats = core.make_stats()  # preempted: its blocks freed, the prefix cache emptied
        assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 1)
        assert stats.kv_cache_usage == 0.0 < stats_before.kv_cache_usage
        assert core.step() == [] and core.has_unfinished_requests() and not core.has_work()
        core.resume()
        final = None
        for _ in range(50):  # bounded: 8 tokens take a few steps
            for output in engine.step():
                final = output
            if not engine.has_unfinished_requests():
                break
        assert final.finished and final.outputs[0].token_ids == expected
        assert final.outputs[0].finish_reason == "length"
        with pytest.raises(ValueError, match="pause mode 'wait' is not one of"):
            core.pause("wait")  # the front end does the waiting
    finally:
        engine.shutdown()


# ---------------------------------------------------------------------- AsyncLLM


@pytest.fixture(scope="module")
def engine(model):
    args = EngineArgs(model=model, skip_tokenizer_init=True, num_kv_blocks=64)
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    engine.shutdown()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, WAIT_S))


class Stream:
    """A generate() consumed by a task: its outputs as they come."""

    def __init__(self, engine: AsyncLLM, request_id: str, params: SamplingParams) -> None:
        self.outputs: list = []
        self.first = asyncio.Event()
        self.task = asyncio.create_task(self._consume(engine, request_id, params))

    async def _consume(self, engine, request_id, params) -> None:
        async for output in engine.generate(PROMPT, params, request_id):
            self.outputs.append(output)
            self.first.set()

    @property
    def final(self):
        assert self.outputs and self.outputs[-1].finished
        return self.outputs[-1].outputs[0]


async def _idle(engine: AsyncLLM) -> tuple[int, int]:
    stats = await engine.get_scheduler_stats()
    return stats.num_running_reqs, stats.num_waiting_reqs


def _successes(engine: AsyncLLM) -> dict[str, float]:
    """``request_success`` by finished reason (vLLM's metric)."""
    return {
        metric.labels["finished_reason"]: metric.value
        for metric in engine.get_metrics()
        if metric.name == "pagedlm:request_success"
    }


def test_abort_ends_in_flight_requests_and_holds_new_ones(engine):
    async def scenario() -> None:
        before = _successes(engine)
        streams = [Stream(engine, f"abort-{i}", LONG) for i in range(3)]
        await asyncio.gather(*(s.first.wait() for s in streams))
        assert not await engine.is_paused()
        await engine.pause_generation()
        assert await engine.is_paused()
        await asyncio.gather(*(s.task for s in streams))  # they ended, with a final output
        for stream in streams:
            assert stream.final.finish_reason == "abort"
            assert 0 < len(stream.final.token_ids) < LONG.max_tokens
        held = Stream(engine, "held", SHORT)
        dropped = [Stream(engine, "dropped", SHORT) for _ in range(2)]  # one id, two calls
        await asyncio.sleep(0.5)
        assert not held.outputs and not held.task.done()  # waiting, not failed
        assert await _idle(engine) == (0, 0)  # and not in the engine core
        await engine.abort("dropped")  # held requests can be aborted: they end unsent
        await asyncio.gather(*(d.task for d in dropped))
        assert not any(d.outputs for d in dropped) and not held.task.done()
        await engine.resume_generation()
        assert not await engine.is_paused()
        await held.task
        assert held.final.finish_reason == "length"
        assert len(held.final.token_ids) == SHORT.max_tokens
        assert await _idle(engine) == (0, 0)  # the aborted one never ran
        # vLLM counts the requests a pause ended as finished with reason "abort" (its core
        # sends them an abort output); a client's abort ("dropped") is not counted.
        after = _successes(engine)
        delta = {reason: after[reason] - before[reason] for reason in after}
        assert delta == {"stop": 0, "length": 1, "abort": 3, "error": 0, "repetition": 0}

    run(scenario())


def test_wait_lets_in_flight_requests_finish(engine):
    async def scenario() -> None:
        streams = [Stream(engine, f"wait-{i}", SHORT) for i in range(2)]
        await asyncio.gather(*(s.first.wait() for s in streams))
        await engine.pause_generation(mode="wait")
        assert all(s.outputs[-1].finished for s in streams)  # finished before it returned
        assert [s.final.finish_reason for s in streams] == ["length", "length"]
        held = Stream(engine, "held-after-wait", SHORT)
        await asyncio.sleep(0.3)
        assert not held.outputs
        await engine.resume_generation()
        await held.task
        assert held.final.finish_reason == "length"

        stream = Stream(engine, "deprecated", SHORT)
        await stream.first.wait()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            await engine.pause_generation(wait_for_inflight_requests=True)
        assert any(issubclass(w.category, DeprecationWarning) for w in caught)
        assert stream.outputs[-1].finished and stream.final.finish_reason == "length"
        await engine.resume_generation()
        with pytest.raises(ValueError, match="pause mode 'later'"):
            await engine.pause_generation(mode="later")
        assert not await engine.is_paused()

    run(scenario())


@pytest.mark.parametrize("clear_cache", [True, False])
def test_keep_freezes_requests_until_resumed(engine, model, clear_cache):
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    delta = SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def scenario() -> None:
        reference = Stream(engine, f"reference-{clear_cache}", greedy)
        await reference.task
        stream = Stream(engine, f"kept-{clear_cache}", delta)
        await stream.first.wait()
        await engine.pause_generation(mode="keep", clear_cache=clear_cache)
        count = len(stream.outputs)
        await asyncio.sleep(0.5)
        assert len(stream.outputs) == count and not stream.task.done()  # frozen
        running, waiting = await _idle(engine)
        assert (running, waiting) == ((0, 1) if clear_cache else (1, 0))
        if clear_cache:  # preempted, so the weights may be replaced meanwhile
            await engine.update_weights_from_disk(model)
        else:
            with pytest.raises(ValueError, match="1 kept requests hold KV cache"):
                await engine.update_weights_from_disk(model)
        await engine.resume_generation()
        await stream.task
        tokens = [t for output in stream.outputs for t in output.outputs[0].token_ids]
        assert stream.outputs[-1].outputs[0].finish_reason == "length"
        assert tokens == list(reference.final.token_ids)  # the same weights: the same tokens

    run(scenario())
