"""Asynchronous scheduling on and off give the same outputs on a real (tiny) model, for a
batch that mixes every per-request feature, under preemption, prefix hits and aborts."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.sampling_params import StructuredOutputsParams
from server.server_utils import write_chat_checkpoint

PREFIX = "A shared opening, two blocks long: "  # 35 byte tokens
PROMPTS = [
    PREFIX + "one",
    "Hello world",
    PREFIX + "two, and a bit more text",
    "Café résumé 😀",
    PREFIX + "three",
    "short",
]


def mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24),
        SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=20, logprobs=3),
        SamplingParams(
            temperature=0.0,
            max_tokens=20,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            logit_bias={5: 4.0, 9: -100.0},
            prompt_logprobs=2,
        ),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16, min_tokens=6, stop=["a"]),
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            structured_outputs=StructuredOutputsParams(regex="(ab|cd)+"),
        ),
        SamplingParams(temperature=0.0, max_tokens=30, stop=["e "], ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return str(write_chat_checkpoint(tmp_path_factory.mktemp("tiny-async")))


def _summary(outputs) -> list:
    summary = []
    for out in outputs:
        for c in out.outputs:
            logprobs = None
            if c.logprobs is not None:
                logprobs = [
                    sorted((t, round(lp.logprob, 4)) for t, lp in row.items()) for row in c.logprobs
                ]
            summary.append(
                (out.request_id, c.index, c.token_ids, c.text, c.finish_reason, logprobs)
            )
        if out.prompt_logprobs is not None:
            summary.append([None if row is None else sorted(row) for row in out.prompt_logprobs])
    return summary


@pytest.mark.parametrize("num_kv_blocks", [64, 8])
def test_async_and_sync_outputs_match(model_path: str, num_kv_blocks: int) -> None:
    check_async_matches_sync(model_path, num_kv_blocks)


@pytest.mark.cuda
@pytest.mark.parametrize("eager", ["0", "1"])
def test_async_and_sync_outputs_match_on_cuda(model_path: str, eager: str, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLM_ENFORCE_EAGER", eager)  # CUDA graphs on, then off
    check_async_matches_sync(model_path, 8, platform="cuda")


def check_async_matches_sync(model_path: str, num_kv_blocks: int, **engine_args) -> None:
    results = []
    for async_scheduling in (False, True):
        llm = LLM(
            model_path,
            async_scheduling=async_scheduling,
            num_kv_blocks=num_kv_blocks,
            **engine_args,
            block_size=16,
            max_model_len=128,
            max_num_batched_tokens=32,  # chunked prefill of the longer prompts
        )
        core = llm.llm_engine.engine_core
        step, left_in_flight = core.step, []

        def recording_step(step=step, core=core, left_in_flight=left_in_flight):
            outputs = step()
            left_in_flight.append(core.has_step_in_flight)
            return outputs

        core.step = recording_step
        outputs = llm.generate(PROMPTS, mixed_params(), use_tqdm=False)
        # The two runs took different paths: only asynchronous scheduling returns from a
        # step with the next one still in flight.
        assert any(left_in_flight) is async_scheduling, left_in_flight
        # Preempted mid-prompt, a request computes part of its prompt again: its prompt
        # logprobs are still reported once per position.
        assert len(outputs[2].prompt_logprobs) == len(outputs[2].prompt_token_ids)
        results.append(_summary(outputs))
        preemptions = llm.llm_engine.engine_core.make_stats().num_preemptions
        if num_kv_blocks == 8:
            assert preemptions > 0, "the small cache should force preemption"
        llm.llm_engine.shutdown()
    assert results[0] == results[1]
    grammar_texts = [entry[3] for entry in results[0] if entry[0] == "4"]
    assert grammar_texts and all(set(t) <= set("abcd") for t in grammar_texts)


def test_abort_with_a_step_in_flight_frees_everything(model_path: str) -> None:
    llm = LLM(model_path, async_scheduling=True, num_kv_blocks=32, max_model_len=256)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(str(i), prompt, params)
    seen: dict[str, int] = {}
    for _ in range(6):
        for out in engine.step():
            seen[out.request_id] = len(out.outputs[0].token_ids)
    assert engine.engine_core.has_step_in_flight
    engine.abort_request(["1"])
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != "1", "an aborted request reported more output"
    core = engine.engine_core
    while core.has_unfinished_requests():  # the last step in flight
        core.step()
    scheduler = core.scheduler
    assert scheduler.kv_manager.num_free_blocks == scheduler.num_blocks
    assert "1" in seen
