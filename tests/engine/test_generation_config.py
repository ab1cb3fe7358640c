"""Requests' default sampling parameters from the model's generation_config.json (vLLM's
``generation_config`` / ``override_generation_config``)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from pagedlm import LLM, SamplingParams
from pagedlm.generation_config import request_fields, sampling_defaults

QWEN3_LIKE = {
    "bos_token_id": 1,
    "do_sample": True,
    "eos_token_id": [2, 3],
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def _folder(tmp_path, config, name="model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps(config))
    return str(folder)


def test_auto_reads_the_sampling_fields_of_the_models_file(tmp_path, caplog):
    model = _folder(tmp_path, {**QWEN3_LIKE, "max_new_tokens": 300, "repetition_penalty": 1.1})
    with caplog.at_level(logging.WARNING, logger="pagedlm.generation_config"):
        defaults = sampling_defaults(model, "auto")
    # do_sample and the token ids are not read; max_new_tokens is vLLM's max_tokens.
    assert defaults == {
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
        "max_tokens": 300,
    }
    assert "generation_config='vllm'" in caplog.text  # the start-up log names the way out
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedlm.generation_config"):
        assert sampling_defaults(model, "auto", log=False) == defaults
    assert not caplog.text


def test_vllm_mode_a_directory_and_overrides(tmp_path):
    model = _folder(tmp_path, QWEN3_LIKE)
    other = _folder(tmp_path, {"temperature": 0.2, "min_p": 0.05}, name="other")
    assert sampling_defaults(model, "vllm") == {}
    assert sampling_defaults(model, other) == {"temperature": 0.2, "min_p": 0.05}
    assert sampling_defaults(model, "auto", {"temperature": 0.5, "max_new_tokens": 9}) == {
        "temperature": 0.5,
        "top_k": 20,
        "top_p": 0.95,
        "max_tokens": 9,
    }
    assert sampling_defaults(model, "vllm", {"top_k": 5}) == {"top_k": 5}
    # No file: nothing (a .gguf path or a directory without one).
    assert sampling_defaults(str(tmp_path / "model.gguf"), "auto") == {}
    assert sampling_defaults(str(tmp_path), "auto") == {}


@pytest.mark.parametrize(
    ("config", "generation_config", "overrides", "needle"),
    [
        (QWEN3_LIKE, "DIR/missing", None, "there is no generation_config.json there"),
        (QWEN3_LIKE, "auto", {"temprature": 0.5}, "['temprature'] not used"),
        ({"temperature": -1.0}, "auto", None, "generation_config='vllm' to ignore the file"),
        ({"top_p": "high"}, "auto", None, "fix them with override_generation_config"),
        (["not", "an", "object"], "auto", None, "not a JSON object"),
    ],
)
def test_bad_configs_are_start_up_errors_that_name_the_fix(
    tmp_path, config, generation_config, overrides, needle
):
    model = _folder(tmp_path, config)
    generation_config = generation_config.replace("DIR", str(tmp_path))
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        sampling_defaults(model, generation_config, overrides)


def test_a_request_keeps_what_it_sets_and_takes_the_rest_from_the_defaults():
    defaults = {"temperature": 0.6, "top_k": 20, "max_tokens": 100}
    requested = {"temperature": None, "top_k": 5, "top_p": None, "max_tokens": None}
    assert request_fields(requested, defaults) == {
        "temperature": 0.6,
        "top_k": 5,
        "max_tokens": 100,
    }
    # max_tokens: the config's caps the request's, as vLLM's server does.
    assert request_fields({"max_tokens": 500}, defaults)["max_tokens"] == 100
    assert request_fields({"max_tokens": 50}, defaults)["max_tokens"] == 50
    # Without defaults: unset fields are left to SamplingParams; max_tokens None = context.
    assert request_fields({"temperature": None, "max_tokens": None}, {}) == {"max_tokens": None}
    assert request_fields({"temperature": 0.0, "max_tokens": 7}, {}) == {
        "temperature": 0.0,
        "max_tokens": 7,
    }


def test_llm_generates_with_the_models_defaults_unless_given_parameters(tiny_checkpoint, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("llama"), model)
    config = json.loads((model / "generation_config.json").read_text())
    config.update(temperature=0.0, max_new_tokens=7)
    (model / "generation_config.json").write_text(json.dumps(config))
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}

    llm = LLM(str(model), skip_tokenizer_init=True)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 7)
    greedy = SamplingParams(temperature=0.0, max_tokens=7)
    expected = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    # No parameters: the file's greedy decoding and length, not SamplingParams()'s.
    for _ in range(2):
        assert llm.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids == expected
    # Given parameters are used as they are.
    sampled = llm.generate(prompt, SamplingParams(max_tokens=3, seed=1), use_tqdm=False)
    assert len(sampled[0].outputs[0].token_ids) == 3
    llm.llm_engine.shutdown()

    plain = LLM(str(model), skip_tokenizer_init=True, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0
    assert plain.get_default_sampling_params().max_tokens == 16
    plain.llm_engine.shutdown()
