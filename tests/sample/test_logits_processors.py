"""Custom logits processors (vLLM v1's interface): the batch bookkeeping they are promised,
their place in the sampler, per-request arguments (``extra_args`` / ``vllm_xargs``), live
output lists under asynchronous scheduling and preemption, loading by name and entry
point, and the errors for what they cannot combine with."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import httpx
import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.engine.arg_utils import EngineArgs
from pagedlm.sample.logits_processor import (
    BatchRequest,
    CustomLogitsProcessors,
    load_logits_processors,
    portable_name,
)
from pagedlm.sample.logits_processor import loading as loading_module
from sample.logits_processor_examples import CountUp, EchoPrompt, StrictBatch, TargetToken, TopOne
from server.server_utils import VOCAB_SIZE, in_process_app

ALL = [TargetToken, CountUp, EchoPrompt, TopOne, StrictBatch]
PROMPTS = ["Hello there", "The quick brown fox", "abc", "Café résumé", "short one", "x y z"]


def _greedy(max_tokens: int = 12, **extra_args) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args or None
    )


def test_batch_updates_keep_their_promises_over_random_batches() -> None:
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_seqs=12))
    strict = StrictBatch(config, None, False)
    processors = CustomLogitsProcessors([strict])
    rng = random.Random(0)
    lists = {key: [key] for key in range(40)}
    for _ in range(300):
        keys = rng.sample(range(40), rng.randint(0, 12))
        processors.update([BatchRequest(key, SamplingParams(), [1], lists[key]) for key in keys])
        # Row i is the request asked for at i: its own output list, by identity.
        assert [strict.slots[i] for i in range(len(keys))] == [lists[k] for k in keys]
        assert all(strict.slots[i] is lists[k] for i, k in enumerate(keys))


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(request, chat_checkpoint):
    llm = LLM(
        str(chat_checkpoint),
        logits_processors=ALL,
        async_scheduling=request.param,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_batched_tokens=24,  # the longer prompts are chunked
    )
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def plain(chat_checkpoint):
    llm = LLM(str(chat_checkpoint), num_kv_blocks=64, max_model_len=128)
    yield llm
    llm.llm_engine.shutdown()


def _tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_each_request_gets_its_own_processor_and_the_others_none(llm, plain) -> None:
    params = [
        _greedy(target_token=77),
        _greedy(count_from=300),
        _greedy(echo=True),
        _greedy(),
        _greedy(count_from=5, target_token=9),  # both act: the target wins the race to -inf
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = _tokens(outputs)
    assert tokens[0] == [77] * 12
    assert tokens[1] == [(300 + i) % VOCAB_SIZE for i in range(12)]
    prompt = outputs[2].prompt_token_ids
    assert tokens[2] == [prompt[i % len(prompt)] for i in range(12)]
    reference = plain.generate([PROMPTS[3], PROMPTS[5]], [params[3], params[5]], use_tqdm=False)
    assert tokens[3] == _tokens(reference)[0], "a request without arguments was changed"
    assert tokens[5] == _tokens(reference)[1], "a seeded request without arguments was changed"


def test_an_argmax_invariant_processor_runs_after_temperature_on_random_rows_only(llm) -> None:
    (top_one,) = [p for p in llm_processors(llm) if isinstance(p, TopOne)]
    applied = top_one.applied
    greedy = llm.generate(PROMPTS[:3], _greedy(), use_tqdm=False)
    assert top_one.applied == applied, "an all-greedy batch ran an argmax-invariant processor"
    random_params = SamplingParams(
        temperature=1.5, max_tokens=12, ignore_eos=True, extra_args={"top_one": True}
    )
    sampled = llm.generate(PROMPTS[:3], random_params, use_tqdm=False)
    assert _tokens(sampled) == _tokens(greedy)
    assert top_one.applied > applied


def llm_processors(llm):
    executor = llm.llm_engine.engine_core.executor
    return executor.worker.runner.logits_processors.processors.processors


def test_output_lists_stay_live_under_preemption(chat_checkpoint) -> None:
    for async_scheduling in (False, True):
        llm = LLM(
            str(chat_checkpoint),
            logits_processors=[CountUp, StrictBatch],
            async_scheduling=async_scheduling,
            num_kv_blocks=8,
            block_size=16,
            max_model_len=128,
        )
        params = [_greedy(40, count_from=10 * i) for i in range(6)]
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert _tokens(outputs) == [[(10 * i + j) for j in range(40)] for i in range(6)]
        assert llm.llm_engine.engine_core.make_stats().num_preemptions > 0
        llm.llm_engine.shutdown()


def test_validate_params_rejects_a_request_before_it_runs(llm) -> None:
    with pytest.raises(ValueError, match="target_token must be a token id"):
        llm.generate("hi", _greedy(target_token="x"), use_tqdm=False)
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=["target_token"])


def test_names_resolve_and_bad_names_say_what_to_do(monkeypatch) -> None:
    monkeypatch.setenv("PAGEDLM_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert load_logits_processors(
        ["sample.logits_processor_examples:TargetToken", "sample.logits_processor_examples.TopOne"]
    ) == (TargetToken, TopOne)
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_logits_processors(["no_such_module:Thing"])
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_logits_processors(["sample.logits_processor_examples:Nope"])
    with pytest.raises(ValueError, match="not a subclass of"):
        load_logits_processors(["pagedlm.sampling_params:SamplingParams"])
    with pytest.raises(ValueError, match="not a qualified name"):
        load_logits_processors(["TargetToken"])

    class Local(TargetToken):
        pass

    with pytest.raises(ValueError, match="define it at the top level"):
        portable_name(Local)
    assert portable_name(TargetToken) == "sample.logits_processor_examples:TargetToken"


def test_installed_entry_points_are_loaded_unless_autoload_is_off(monkeypatch) -> None:
    entry = SimpleNamespace(name="top-one", load=lambda: TopOne)
    monkeypatch.setattr(
        loading_module,
        "entry_points",
        lambda group: [entry] if group == "pagedlm.logits_processors" else [],
    )
    monkeypatch.delenv("PAGEDLM_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    assert load_logits_processors([TargetToken, TopOne]) == (TargetToken, TopOne)
    assert load_logits_processors([]) == (TopOne,)
    monkeypatch.setenv("PAGEDLM_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert load_logits_processors([]) == ()


def test_what_processors_cannot_combine_with_is_a_start_up_error(chat_checkpoint) -> None:
    with pytest.raises(ValueError, match="do not combine with speculative_config"):
        EngineArgs(
            model=str(chat_checkpoint),
            logits_processors=[TargetToken],
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        ).create_engine_config()
    with pytest.raises(ValueError, match="runner='pooling' samples nothing"):
        EngineArgs(
            model=str(chat_checkpoint), logits_processors=[TargetToken], runner="pooling"
        ).create_engine_config()


def test_the_flag_takes_several_names() -> None:
    import argparse

    from pagedlm.engine.cli_args import add_engine_args, engine_args_from_cli

    parser = add_engine_args(argparse.ArgumentParser())
    namespace = parser.parse_args(["--logits-processors", "a.b:C", "d.e.F"])
    assert engine_args_from_cli(namespace).logits_processors == ["a.b:C", "d.e.F"]


def test_over_http_vllm_xargs_reach_the_processor_and_bad_ones_are_400(
    chat_checkpoint, monkeypatch, request
) -> None:
    tests_dir = str(request.config.rootpath / "tests")
    monkeypatch.setenv("PYTHONPATH", tests_dir)  # the engine core imports the class by name
    engine, app = in_process_app(
        chat_checkpoint, logits_processors=[TargetToken], num_kv_blocks=32, max_model_len=128
    )

    async def run() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"model": "tiny", "prompt": "Hi", "max_tokens": 6, "temperature": 0}
            bad, good = await asyncio.gather(
                client.post("/v1/completions", json={**body, "vllm_xargs": {"target_token": "x"}}),
                client.post(
                    "/v1/completions",
                    json={**body, "vllm_xargs": {"target_token": 70}, "return_token_ids": True},
                ),
            )
            assert bad.status_code == 400, bad.text
            assert "target_token must be a token id" in bad.json()["error"]["message"]
            assert good.status_code == 200, good.text
            assert good.json()["choices"][0]["token_ids"] == [70] * 6
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "vllm_xargs": {"target_token": 71},
                    "return_token_ids": True,
                },
            )
            assert chat.json()["choices"][0]["token_ids"] == [71] * 4

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_classes_cross_to_worker_processes_by_name(chat_checkpoint) -> None:
    from pagedlm.executor.worker_messages import decode_config, encode_config
    from pagedlm.sample.logits_processor.loading import resolve

    config, _ = EngineArgs(
        model=str(chat_checkpoint),
        logits_processors=[TargetToken, "sample.logits_processor_examples:TopOne"],
    ).create_engine_config()
    assert config.logits_processors == (TargetToken, TopOne)
    remote = decode_config(encode_config(config))
    assert remote.logits_processors == (
        "sample.logits_processor_examples:TargetToken",
        "sample.logits_processor_examples:TopOne",
    )
    assert [resolve(spec) for spec in remote.logits_processors] == [TargetToken, TopOne]


def test_per_request_callables_are_refused_naming_the_engine_processors() -> None:
    """vLLM v1 refuses SamplingParams(logits_processors=...); it was Python's TypeError."""
    import dataclasses

    def ban_token_zero(token_ids, logits):
        return logits

    with pytest.raises(ValueError, match=r"per-request logits processors") as refused:
        SamplingParams(logits_processors=[ban_token_zero])
    assert "LLM(logits_processors=[" in str(refused.value)
    assert "AdapterLogitsProcessor" in str(refused.value)
    # None or an empty list ask for nothing (as in vLLM), and nothing is stored or sent.
    params = SamplingParams(logits_processors=[], temperature=0.0)
    assert params.logits_processors is None and params.temperature == 0.0
    assert "logits_processors" not in {f.name for f in dataclasses.fields(SamplingParams)}
    assert dataclasses.replace(params, n=2).n == 2
    # The step protocol decodes SamplingParams with msgspec, which refuses an InitVar.
    from pagedlm.step import codec

    assert codec.decode(codec.encode(params), SamplingParams) == params
