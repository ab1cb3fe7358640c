"""A custom logits processor that raises fails requests, never the engine: a per-request
callable (``AdapterLogitsProcessor``) fails its request alone, which ends with finish reason
"error" while the rest of its batch gets the tokens it would have had alone; a batch
processor fails the rows of its step. Offline, ``LLM.generate`` raises
``RequestFailedError`` once the call's other requests are done; over HTTP the failed
request alone gets a 500 naming the processor."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.engine.exceptions import RequestFailedError
from pagedlm.sample.logits_processor import BatchRequest, CustomLogitsProcessors
from pagedlm.step import ModelRunnerOutput
from pagedlm.step.codec import decode, encode
from sample.logits_processor_examples import BatchRaise, RaiseAt, StrictBatch
from server.server_utils import in_process_app

PROMPTS = ["Hello there", "The quick brown fox", "abc", "Café résumé"]


def _greedy(max_tokens: int = 6, **extra_args) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args or None
    )


def _seeded(**extra_args) -> SamplingParams:
    return SamplingParams(
        temperature=1.0, seed=11, max_tokens=6, ignore_eos=True, extra_args=extra_args or None
    )


def _tokens(output) -> list[int]:
    return list(output.outputs[0].token_ids)


# -- the batch bookkeeping, without a model -------------------------------------------------


def _batch(keys, extra_args=None) -> list[BatchRequest]:
    extra = extra_args or {}
    return [BatchRequest(key, SamplingParams(extra_args=extra.get(key)), [1], []) for key in keys]


def test_a_raising_callable_fails_its_row_alone_and_is_not_called_again() -> None:
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8))
    raising = RaiseAt(config, None, False)
    strict = StrictBatch(config, None, False)
    processors = CustomLogitsProcessors([raising, strict])
    processors.update(_batch([5, 6, 7], {6: {"raise_at": 0}, 7: {"raise_on_params": True}}))
    logits = torch.zeros(3, 4)
    assert processors.apply(logits, argmax_invariant=False) is logits
    failures = processors.take_failures()
    assert sorted(failures) == [1, 2]
    assert failures[1] == "logits processor RaiseAt raised ValueError: boom after 0 tokens"
    assert failures[2].startswith("logits processor RaiseAt raised KeyError")
    # the failed requests stay failed (reported again, never called) until they leave
    processors.update(_batch([6, 5]))
    processors.apply(torch.zeros(2, 4), argmax_invariant=False)
    assert list(processors.take_failures()) == [0]
    processors.update(_batch([5]))
    processors.apply(torch.zeros(1, 4), argmax_invariant=False)
    assert processors.take_failures() == {}


def test_a_raising_batch_processor_fails_its_step_and_is_told_the_batch_afresh() -> None:
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=8))
    batch = BatchRaise(config, None, False)
    processors = CustomLogitsProcessors([batch])
    processors.update(_batch([1, 2, 3]))
    processors.update(_batch([3, 4, 2], {4: {"batch_raise": "update_state"}}))
    assert processors.apply(torch.zeros(3, 4), argmax_invariant=False).shape == (3, 4)
    failures = processors.take_failures()
    assert sorted(failures) == [0, 1, 2]
    assert failures[0] == (
        "logits processor BatchRaise.update_state raised RuntimeError: cannot take this request"
    )
    # the next update gives it the whole batch again: its own checks pass
    processors.update(_batch([2, 5]))
    processors.apply(torch.zeros(2, 4), argmax_invariant=False)
    assert processors.take_failures() == {}
    assert batch.size == 2 and sorted(batch.rows) == [0, 1]
    processors.update(_batch([2, 5, 6], {6: {"batch_raise": "apply"}}))
    processors.apply(torch.zeros(3, 4), argmax_invariant=False)
    assert set(processors.take_failures().values()) == {
        "logits processor BatchRaise.apply raised RuntimeError: this batch breaks me"
    }


def test_a_steps_failures_cross_the_step_protocol() -> None:
    output = ModelRunnerOutput(["a", "b"], [[1], [2]], failed={"b": "it broke"})
    assert decode(encode(output), ModelRunnerOutput).failed == {"b": "it broke"}


# -- offline ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, chat_checkpoint):
    llm = LLM(
        str(chat_checkpoint),
        logits_processors=[RaiseAt, BatchRaise, StrictBatch],
        async_scheduling=request.param,
        num_kv_blocks=64,
        max_model_len=128,
    )
    yield llm
    llm.llm_engine.shutdown()


def test_a_raising_request_processor_fails_that_request_alone(llm) -> None:
    alone = [
        _tokens(out)
        for out in llm.generate([PROMPTS[0], PROMPTS[2]], [_greedy(), _seeded()], use_tqdm=False)
    ]
    params = [_greedy(), _greedy(raise_at=3), _seeded(), _greedy(raise_on_params=True)]
    with pytest.raises(RequestFailedError) as failed:
        llm.generate(PROMPTS, params, use_tqdm=False)
    error = failed.value
    assert "(prompt 1 of the call) logits processor RaiseAt raised ValueError: boom after 3" in (
        str(error)
    )
    assert "1 more of this call's prompts failed too" in str(error)
    outputs = error.outputs
    assert [_tokens(outputs[0]), _tokens(outputs[2])] == alone
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "error", "length", "error"]
    assert len(_tokens(outputs[1])) == 3  # the tokens before the failing step, none after
    assert _tokens(outputs[3]) == []
    assert outputs[3].outputs[0].stop_reason.startswith("logits processor RaiseAt raised KeyError")
    # the engine goes on, and so do the other processors (StrictBatch checks every update)
    again = llm.generate([PROMPTS[0], PROMPTS[2]], [_greedy(), _seeded()], use_tqdm=False)
    assert [_tokens(out) for out in again] == alone


@pytest.mark.parametrize("how", ["apply", "update_state"])
def test_a_raising_batch_processor_fails_its_batch_and_the_engine_goes_on(llm, how) -> None:
    alone = _tokens(llm.generate(PROMPTS[0], _greedy(), use_tqdm=False)[0])
    with pytest.raises(RequestFailedError, match=f"BatchRaise.{how} raised RuntimeError"):
        llm.generate(PROMPTS[:2], [_greedy(), _greedy(batch_raise=how)], use_tqdm=False)
    assert _tokens(llm.generate(PROMPTS[0], _greedy(), use_tqdm=False)[0]) == alone


# -- over HTTP ----------------------------------------------------------------------------


def test_over_http_the_failed_request_alone_gets_an_error(
    chat_checkpoint, monkeypatch, request
) -> None:
    """A 500 naming the processor (an error event once a stream started), while a request
    in the same batch completes with the tokens it has alone; the server serves on."""
    monkeypatch.setenv("PYTHONPATH", str(request.config.rootpath / "tests"))
    engine, app = in_process_app(
        chat_checkpoint, logits_processors=[RaiseAt], num_kv_blocks=32, max_model_len=128
    )
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            alone = await client.post("/v1/completions", json=body)
            bad, good, streamed = await asyncio.gather(
                client.post("/v1/completions", json={**body, "vllm_xargs": {"raise_at": 2}}),
                client.post("/v1/completions", json=body),
                client.post(
                    "/v1/chat/completions",
                    json={
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "Hi"}],
                        "max_tokens": 8,
                        "stream": True,
                        "vllm_xargs": {"raise_at": 3},
                    },
                ),
            )
            assert bad.status_code == 500, bad.text
            message = bad.json()["error"]["message"]
            assert "logits processor RaiseAt raised ValueError: boom after 2 tokens" in message
            assert good.status_code == 200, good.text
            expected = alone.json()["choices"][0]["token_ids"]
            assert good.json()["choices"][0]["token_ids"] == expected
            events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == 500 and "boom after 3 tokens" in error["message"]
            at_once = await client.post(
                "/v1/completions", json={**body, "vllm_xargs": {"raise_on_params": True}}
            )
            assert at_once.status_code == 500
            assert "RaiseAt raised KeyError" in at_once.json()["error"]["message"]
            after = await client.post("/v1/completions", json=body)
            assert after.json()["choices"][0]["token_ids"] == expected

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()
