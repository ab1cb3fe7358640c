"""Bad input raises ValueError naming the fix, before anything enters the engine."""

from __future__ import annotations

import numpy as np
import pytest

from pagedlm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, max_model_len=256)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"temperature": float("nan")}, "temperature must be a finite"),
        ({"temperature": float("inf")}, "temperature must be a finite"),
        ({"temperature": 2.5}, r"temperature must be in \[0, 2\]"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite"),
        ({"top_p": float("nan")}, "top_p must be a finite"),
        ({"presence_penalty": "1"}, "presence_penalty must be a number"),
        ({"seed": 2**64}, "seed must be a 64-bit integer"),
        ({"seed": -(2**63) - 1}, "seed must be a 64-bit integer"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias values must be finite"),
        ({"logit_bias": {5: 1e308}}, "logit_bias values must be finite"),  # inf in float32
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids must be integers"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n must be"),
        ({"logprobs": -2}, "logprobs must be -1"),  # the engine's max_logprobs caps it
        ({"max_tokens": 0}, "max_tokens"),
        # Wrong types: each crashed a step (the engine then hung or, behind AsyncLLM,
        # the engine core died decoding the request) instead of failing here.
        ({"logprobs": 2.5}, "logprobs must be an integer"),
        ({"prompt_logprobs": 2.5}, "prompt_logprobs must be an integer"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer"),
        ({"max_tokens": "4"}, "max_tokens must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of token ids"),
        ({"allowed_token_ids": "12"}, "allowed_token_ids must be a list of token ids"),
        ({"bad_words": 5}, "bad_words must be a string or a list of strings"),
        ({"ignore_eos": "yes"}, "ignore_eos must be True or False"),
        ({"detokenize": 1}, "detokenize must be True or False"),
        ({"logit_bias": [1]}, "logit_bias must map token ids"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias must map token ids"),
        ({"output_kind": "delta"}, "output_kind must be a RequestOutputKind"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_params_normalization():
    params = SamplingParams(top_k=0, stop_token_ids=[7, 3, 7, 9, 3], seed=2**64 - 1)
    assert params.top_k == -1  # vLLM: 0 disables top-k, like -1
    assert params.stop_token_ids == [7, 3, 9]
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed"
    params = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert (params.logprobs, params.prompt_logprobs) == (1, 1)  # vLLM's: True is 1
    # NumPy integers become ints (the engine core's wire format takes no others); JSON's
    # string keys of logit_bias become token ids.
    params = SamplingParams(
        max_tokens=np.int64(3),
        seed=np.uint64(2**64 - 1),
        logprobs=np.int32(2),
        stop_token_ids=np.array([4, 5]),
        logit_bias={"6": 1, np.int64(7): np.float32(-2.0)},
        skip_special_tokens=np.False_,  # NumPy's bools become bools
    )
    assert params.skip_special_tokens is False
    assert (params.max_tokens, params.seed, params.logprobs) == (3, 2**64 - 1, 2)
    assert params.stop_token_ids == [4, 5] and params.logit_bias == {6: 1.0, 7: -2.0}
    assert all(type(v) is int for v in (params.max_tokens, params.seed, *params.stop_token_ids))


def test_token_ids_and_ranges_checked_against_the_model(llm):
    # The tiny llama has a vocabulary of 384.
    good = {"prompt_token_ids": [1, 2, 3]}
    for params, match in [
        (SamplingParams(top_k=385), "top_k=385 exceeds the vocabulary size"),
        (SamplingParams(stop_token_ids=[2**70]), "stop_token_ids token id"),
        (SamplingParams(stop_token_ids=[-1]), "stop_token_ids token id -1"),
        (SamplingParams(logit_bias={384: 1.0}), "logit_bias token id 384"),
        (SamplingParams(logprobs=21), "logprobs=21 exceeds max_logprobs=20"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.generate(good, params, use_tqdm=False)
    with pytest.raises(ValueError, match="priority must be a 64-bit integer"):
        llm.llm_engine.input_processor.process("r", good, SamplingParams(), priority=2**63)
    assert not llm.llm_engine.has_unfinished_requests()
    top = SamplingParams(top_k=384, max_tokens=2, ignore_eos=True, seed=1)
    assert len(llm.generate(good, top, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_seeds_at_the_64_bit_edges_run(llm):
    # n samples get seeds seed, seed + 1, ...; at the top of the range they wrap around.
    good = {"prompt_token_ids": [1, 2, 3]}
    for seed in (2**64 - 1, -(2**63)):
        params = SamplingParams(n=3, seed=seed, max_tokens=2, ignore_eos=True)
        outputs = llm.generate(good, params, use_tqdm=False)[0].outputs
        assert [len(o.token_ids) for o in outputs] == [2, 2, 2]
    processed = llm.llm_engine.input_processor.process(
        "wrap", good, SamplingParams(n=3, seed=2**64 - 2)
    )
    assert [c.sampling_params.seed for c in processed.children] == [2**64 - 2, 2**64 - 1, 0]


def test_bad_prompts_leave_the_engine_untouched(llm):
    good = {"prompt_token_ids": [1, 2, 3]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids
    bad_cases = [
        ({"prompt_token_ids": []}, params, "empty"),
        ({"prompt_token_ids": [1, 384]}, params, "outside the vocabulary"),
        ({"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=10), "max_model_len"),
        ("text prompt", params, "skip_tokenizer_init"),
        # Not rounded or parsed into other tokens.
        ({"prompt_token_ids": [1.7, 2.2]}, params, "prompt_token_ids must be a list of token"),
        ({"prompt_token_ids": ["1"]}, params, "got '1' in them"),
        ({"prompt_token_ids": [[1, 2]]}, params, "got \\[1, 2\\] in them"),
    ]
    for prompt, p, match in bad_cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([good, prompt], [params, p], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    # A field set after the SamplingParams was built is checked too: logprobs=2.5 failed
    # inside the step, and the request stayed queued, failing every later call.
    mutated = SamplingParams(max_tokens=4)
    mutated.logprobs = 2.5
    with pytest.raises(ValueError, match="logprobs must be an integer"):
        llm.generate([good, good], [params, mutated], use_tqdm=False)
    for wrong in ({"temperature": 0}, [params, None], "params"):
        with pytest.raises(TypeError, match="sampling_params must be a SamplingParams"):
            llm.generate([good, good], wrong, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    as_array = {"prompt_token_ids": np.array([1, 2, 3])}
    assert llm.generate(as_array, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    for nothing in (None, 5):
        with pytest.raises(TypeError, match="prompts must be a string, a prompt dict"):
            llm.generate(nothing, params, use_tqdm=False)


def test_unknown_model_path():
    with pytest.raises(ValueError, match="not found"):
        LLM("/nonexistent/model")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"architectures": ["FancyNetForCausalLM"], "vocab_size": 10, "hidden_size": 8,'
        ' "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 16}'
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_never_fits_in_kv_cache(tiny_checkpoint):
    llm = LLM(
        str(tiny_checkpoint("llama")),
        skip_tokenizer_init=True,
        num_kv_blocks=4,
        block_size=16,
        max_model_len=512,
    )
    with pytest.raises(ValueError, match="num_kv_blocks"):
        llm.generate({"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=10), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_model_len_above_model_limit(tiny_checkpoint):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, max_model_len=100000)


def test_unknown_platform(tiny_checkpoint):
    with pytest.raises(ValueError, match="known platforms: cpu"):
        LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, platform="tpu")


def test_a_failed_step_leaves_nothing_queued(llm, monkeypatch):
    """A step that raises (an engine bug, or Ctrl-C) ends the call's requests: they stayed
    queued, and every later generate stepped them again and spun forever."""
    good = {"prompt_token_ids": [1, 2, 3]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate([good, good], params, use_tqdm=False)
    runner = llm.llm_engine.engine_core.executor.worker.runner
    sampler = runner.sampler
    calls = []

    def fail_the_second_step(*args, **kwargs):
        calls.append(None)
        if len(calls) == 2:
            raise RuntimeError("sampler failed")
        return sampler(*args, **kwargs)

    monkeypatch.setattr(runner, "sampler", fail_the_second_step)
    with pytest.raises(RuntimeError, match="sampler failed"):
        llm.generate([good, good], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    monkeypatch.setattr(runner, "sampler", sampler)
    again = llm.generate([good, good], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]
    # A progress-bar callable that fails before the first step.
    with pytest.raises(TypeError):
        llm.generate(good, params, use_tqdm=lambda: None)
    assert not llm.llm_engine.has_unfinished_requests()
