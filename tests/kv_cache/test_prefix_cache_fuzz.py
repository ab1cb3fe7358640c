"""Property-based fuzzing of the prefix cache end to end (tiny random Llama, CPU, fp32).

Hypothesis draws an engine (block size, chunking budget, a cache small enough to evict and
preempt, asynchronous scheduling, n-gram speculation) and rounds of requests that share
prefixes, each with or without one of two LoRA adapters, a cache salt, prompt logprobs and
``n``. The properties:

- every request's greedy tokens, logprobs and prompt logprobs are those of the same request
  run alone on an engine without prefix caching;
- ``num_cached_tokens`` is whole blocks, leaves the last prompt token to compute, and is 0
  for a prompt-logprobs request (it needs every position's logits);
- once a round has finished, the block pool is consistent: no request holds a block, every
  block is free, and the index maps each hash to the one block that carries it.

The default run draws a few engines; ``-m slow`` draws many more.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlm import LLM, LoRARequest, SamplingParams
from peft_adapters import LLAMA_MODULES, make_adapter

VOCAB = 384
FAST_EXAMPLES = 3
SLOW_EXAMPLES = 40
FUZZ_SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@dataclass(frozen=True)
class Call:
    prefix: int
    suffix: tuple[int, ...]
    lora: int | None
    salt: str | None
    max_tokens: int
    prompt_logprobs: bool
    n: int


tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12).map(tuple)
calls = st.builds(
    Call,
    prefix=st.integers(0, 2),
    suffix=tokens,
    lora=st.sampled_from([None, None, 0, 1]),
    salt=st.sampled_from([None, None, "alice", "bob"]),
    max_tokens=st.integers(1, 8),
    prompt_logprobs=st.booleans(),
    n=st.sampled_from([1, 1, 2]),
)
engines = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([2, 4, 8]),
        "max_num_batched_tokens": st.sampled_from([16, 64, 256]),
        "cache_tokens": st.sampled_from([160, 256, 800]),
        "max_num_seqs": st.sampled_from([2, 16]),
        "async_scheduling": st.booleans(),
        "speculative_tokens": st.sampled_from([0, 0, 1, 3]),
    }
)
plans = st.tuples(
    engines,
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24), min_size=3, max_size=3),
    st.lists(st.lists(calls, min_size=1, max_size=6), min_size=1, max_size=2),
)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    """(checkpoint, two adapters, a reference for (block size, prompt, adapter, params))."""
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("prefix-fuzz")
    loras = []
    for index in range(2):
        make_adapter(base, root / f"a{index}", LLAMA_MODULES, seed=index + 1)
        loras.append(LoRARequest(f"a{index}", index + 1, str(root / f"a{index}")))
    references: dict[int, LLM] = {}
    answers: dict[tuple, object] = {}

    def reference(block_size: int, prompt: list[int], lora, params: SamplingParams):
        key = (block_size, tuple(prompt), lora, params.max_tokens, params.prompt_logprobs)
        if key not in answers:
            if block_size not in references:
                references[block_size] = LLM(
                    str(base), enable_prefix_caching=False, num_kv_blocks=800 // block_size,
                    **_common(block_size),
                )  # fmt: skip
            llm = references[block_size]
            answers[key] = llm.generate(
                [{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora
            )[0]
        return answers[key]

    yield base, loras, reference
    for llm in references.values():
        llm.llm_engine.shutdown()


def _common(block_size: int) -> dict:
    return dict(
        skip_tokenizer_init=True,
        block_size=block_size,
        max_model_len=128,
        enable_lora=True,
        max_lora_rank=8,
        max_loras=2,
    )


def _engine(base, config: dict) -> LLM:
    block_size = config["block_size"]
    speculative = None
    if config["speculative_tokens"]:
        speculative = {
            "method": "ngram",
            "num_speculative_tokens": config["speculative_tokens"],
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "min_acceptance_rate": 0,
        }
    return LLM(
        str(base),
        num_kv_blocks=config["cache_tokens"] // block_size,
        max_num_batched_tokens=config["max_num_batched_tokens"],
        max_num_seqs=config["max_num_seqs"],
        async_scheduling=config["async_scheduling"],
        speculative_config=speculative,
        **_common(block_size),
    )


def _assert_close(got: dict, want: dict) -> None:
    for token_id, logprob in want.items():
        assert got[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-3)


def _assert_pool_consistent(llm: LLM) -> None:
    manager = llm.llm_engine.engine_core.scheduler.kv_manager
    pool = manager.pool
    assert not manager._tables
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.block_hash == block_hash for block_hash, block in pool._cached.items())
    assert sum(block.block_hash is not None for block in pool.blocks) == len(pool._cached)


def _check_plan(setup, plan) -> None:
    base, loras, reference = setup
    config, prefixes, rounds = plan
    block_size = config["block_size"]
    llm = _engine(base, config)
    try:
        for calls_of_round in rounds:
            prompts, params, adapters = [], [], []
            for call in calls_of_round:
                prompt: dict = {"prompt_token_ids": prefixes[call.prefix] + list(call.suffix)}
                if call.salt is not None:
                    prompt["cache_salt"] = call.salt
                prompts.append(prompt)
                params.append(
                    SamplingParams(
                        n=call.n,
                        temperature=0.0,
                        max_tokens=call.max_tokens,
                        ignore_eos=True,
                        logprobs=2,
                        prompt_logprobs=1 if call.prompt_logprobs else None,
                    )
                )
                adapters.append(None if call.lora is None else loras[call.lora])
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters)
            for prompt, sampling, lora, output in zip(prompts, params, adapters, outputs):
                ids = prompt["prompt_token_ids"]
                alone = SamplingParams(
                    temperature=0.0,
                    max_tokens=sampling.max_tokens,
                    ignore_eos=True,
                    logprobs=2,
                    prompt_logprobs=sampling.prompt_logprobs,
                )
                want = reference(block_size, ids, lora, alone)
                assert output.num_cached_tokens % block_size == 0
                assert output.num_cached_tokens <= len(ids) - 1
                if sampling.prompt_logprobs is not None:
                    assert output.num_cached_tokens == 0
                    assert len(output.prompt_logprobs) == len(want.prompt_logprobs)
                    for got_row, want_row in zip(output.prompt_logprobs, want.prompt_logprobs):
                        assert (got_row is None) == (want_row is None)
                        if want_row is not None:
                            _assert_close(got_row, want_row)
                assert len(output.outputs) == sampling.n
                for sample in output.outputs:
                    assert sample.token_ids == want.outputs[0].token_ids, (prompt, lora)
                    for got_row, want_row in zip(sample.logprobs, want.outputs[0].logprobs):
                        _assert_close(got_row, want_row)
            _assert_pool_consistent(llm)
    finally:
        llm.llm_engine.shutdown()


@settings(max_examples=FAST_EXAMPLES, **FUZZ_SETTINGS)
@given(plan=plans)
def test_prefix_cache_outputs_are_those_of_requests_alone(setup, plan):
    _check_plan(setup, plan)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **FUZZ_SETTINGS)
@given(plan=plans)
def test_prefix_cache_outputs_are_those_of_requests_alone_many(setup, plan):
    _check_plan(setup, plan)
