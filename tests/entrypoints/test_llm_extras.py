"""vLLM's smaller ``LLM`` surface: ``model_config``, ``start_profile``/``stop_profile`` (a
torch trace of the engine's steps) and ``encode``'s ``pooling_task``."""

from __future__ import annotations

import pytest

from pagedlm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, num_kv_blocks=16,
              max_model_len=64)  # fmt: skip
    yield llm
    llm.llm_engine.shutdown()


def test_model_config(llm):
    assert llm.model_config.max_model_len == 64 and llm.model_config is llm.llm_engine.config.model


def test_a_profile_writes_a_trace_of_the_steps(llm, tmp_path, monkeypatch):
    llm.start_profile(str(tmp_path / "a"))
    with pytest.raises(ValueError, match="already running"):
        llm.start_profile(str(tmp_path / "b"))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3), use_tqdm=False)
    llm.stop_profile()
    [trace] = (tmp_path / "a").iterdir()
    assert "engine_core" in trace.name and trace.stat().st_size > 0
    with pytest.raises(ValueError, match="No profile is running"):
        llm.stop_profile()
    monkeypatch.delenv("PAGEDLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "env"))
    llm.start_profile()  # vLLM's variable names the directory
    llm.stop_profile()
    assert list((tmp_path / "env").iterdir())
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR")
    with pytest.raises(ValueError, match="PAGEDLM_TORCH_PROFILER_DIR"):
        llm.start_profile()


def test_pooling_task_is_checked_against_the_model(llm):
    prompt = {"prompt_token_ids": [1, 2]}
    with pytest.raises(ValueError, match="needs a pooling model"):
        llm.encode(prompt, pooling_task="embed", use_tqdm=False)
    with pytest.raises(ValueError, match="token_embed needs a pooling model"):
        llm.encode(prompt, pooling_task="token_embed", use_tqdm=False)
    with pytest.raises(ValueError, match="pooling task 'reward' is unknown"):
        llm.encode(prompt, pooling_task="reward", use_tqdm=False)
    with pytest.raises(ValueError, match="token_classify needs a pooling model"):
        llm.reward(prompt, use_tqdm=False)
