"""Bad input raises ValueError naming the fix, before anything enters the engine."""

from __future__ import annotations

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
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n must be"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_the_engine_untouched(llm):
    good = {"prompt_token_ids": [1, 2, 3]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    expected = llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids
    bad_cases = [
        ({"prompt_token_ids": []}, params, "empty"),
        ({"prompt_token_ids": [1, 384]}, params, "outside the vocabulary"),
        ({"prompt_token_ids": [1] * 250}, SamplingParams(max_tokens=10), "max_model_len"),
        ("text prompt", params, "skip_tokenizer_init"),
    ]
    for prompt, p, match in bad_cases:
        with pytest.raises(ValueError, match=match):
            llm.generate([good, prompt], [params, p], use_tqdm=False)
        assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate(good, params, use_tqdm=False)[0].outputs[0].token_ids == expected


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
