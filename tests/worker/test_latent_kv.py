"""When a DeepSeek model runs its latent attention over the latent cache, and what the
cache then holds (``pagedlm.worker.latent_kv``)."""

from __future__ import annotations

import types

import torch

from model_executor.test_zoo_models_deepseek import CASES, MLA, save_deepseek
from pagedlm import LLM, SamplingParams
from pagedlm.config import LoRAConfig
from pagedlm.worker.latent_kv import latent_kv_refusal
from pagedlm_cpu.attention import CpuSdpaBackend


class NoLatentBackend(CpuSdpaBackend):
    name = "no_latent"
    supports_latent_kv = False


def _config():
    return types.SimpleNamespace(lora=None, batch_invariant=False)


def test_what_keeps_the_expanded_form(monkeypatch) -> None:
    monkeypatch.delenv("PAGEDLM_MLA_DISABLE", raising=False)
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    assert latent_kv_refusal(_config(), CpuSdpaBackend) is None
    assert "no latent attention" in latent_kv_refusal(_config(), NoLatentBackend)
    lora = types.SimpleNamespace(lora=LoRAConfig(), batch_invariant=False)
    assert "LoRA" in latent_kv_refusal(lora, CpuSdpaBackend)
    invariant = types.SimpleNamespace(lora=None, batch_invariant=True)
    assert "batch-invariant" in latent_kv_refusal(invariant, CpuSdpaBackend)
    monkeypatch.setenv("VLLM_MLA_DISABLE", "1")
    assert latent_kv_refusal(_config(), CpuSdpaBackend) == "VLLM_MLA_DISABLE=1"
    monkeypatch.setenv("VLLM_MLA_DISABLE", "0")
    assert latent_kv_refusal(_config(), CpuSdpaBackend) is None


def _run(path, **kwargs) -> tuple[list, list, object]:
    llm = LLM(str(path), skip_tokenizer_init=True, max_model_len=128, **kwargs)
    try:
        prompts = [[5, 9, 2, 77, 31, 8, 100, 3, 3, 64], [42], list(range(7, 47))]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runner = llm.llm_engine.engine_core.executor.worker.model_runner
        logprobs = [
            [o.prompt_logprobs[i][t].logprob for i, t in enumerate(o.prompt_token_ids) if i]
            for o in outs
        ]
        return [o.outputs[0].token_ids for o in outs], logprobs, runner
    finally:
        llm.llm_engine.shutdown()


def _max_difference(got: list, want: list) -> float:
    return max(
        abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)
    )


def test_the_latent_cache_takes_fewer_bytes_per_block_and_serves_fp8(tmp_path, monkeypatch) -> None:
    """Per block the latent cache holds one vector of kv_lora_rank + qk_rope per token and
    layer where the expanded one holds every head's keys and values. An FP8 latent cache
    (one scale: the keys are the values) moves the prompt logprobs of this tiny random
    model about as far from float32 as an FP8 expanded cache does (measured: 0.68 against
    0.46; the latent's rounding passes through the folded kv_b_proj maps)."""
    save_deepseek(tmp_path, *CASES["v3"], cache_head_dim=False)
    _, logprobs, runner = _run(tmp_path)
    latent_bytes = runner.kv_bytes_per_block()
    width = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    layers = MLA["num_hidden_layers"]
    assert latent_bytes == runner.block_size * layers * width * 4  # float32, one tensor
    _, fp8_logprobs, fp8_runner = _run(tmp_path, kv_cache_dtype="fp8")
    key_cache, value_cache = fp8_runner.kv_cache.layer(0)
    assert key_cache is value_cache and key_cache.dtype == torch.float8_e4m3fn
    assert fp8_runner.kv_bytes_per_block() == latent_bytes // 4
    latent_error = _max_difference(fp8_logprobs, logprobs)

    monkeypatch.setenv("PAGEDLM_MLA_DISABLE", "1")
    _, expanded_logprobs, expanded_runner = _run(tmp_path)
    heads = MLA["num_key_value_heads"]
    key_dim = MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]
    assert (
        expanded_runner.kv_bytes_per_block() == runner.block_size * layers * 2 * heads * key_dim * 4
    )
    agree = 1e-4 if runner.device.type == "cpu" else 5e-3  # GPUs: TF32 dots
    assert _max_difference(expanded_logprobs, logprobs) < agree  # the two forms agree
    _, expanded_fp8, _ = _run(tmp_path, kv_cache_dtype="fp8")
    expanded_error = _max_difference(expanded_fp8, expanded_logprobs)
    assert 0 < latent_error < 2 * expanded_error, (latent_error, expanded_error)


def test_speculative_verification_over_the_latent_cache(tmp_path) -> None:
    """Verification steps (1 + k query rows per request) and rejected drafts' slots
    written over read the latent cache as decodes do: n-gram speculation and a draft model
    leave greedy tokens unchanged."""
    save_deepseek(tmp_path, *CASES["v2_lite"], cache_head_dim=False)
    prompts = [[5, 9, 2, 77, 5, 9, 2, 77, 5, 9, 2], [42, 8, 42, 8, 42, 8], list(range(7, 47))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = []
    ngram = {"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # The target as its own draft model (its KV cache its own, expanded): every draft right.
    itself = {"method": "draft_model", "model": str(tmp_path)}
    for method in (None, ngram, itself):
        speculative = method and {**method, "num_speculative_tokens": 3, "min_acceptance_rate": 0}
        llm = LLM(
            str(tmp_path),
            skip_tokenizer_init=True,
            max_model_len=128,
            speculative_config=speculative,
            disable_log_stats=False,
        )
        try:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            runner = llm.llm_engine.engine_core.executor.worker.model_runner
            assert runner.kv_geometry.shares_values
            results.append([o.outputs[0].token_ids for o in outs])
            if speculative is not None:
                metrics = {m.name: m for m in llm.get_metrics()}
                assert metrics["pagedlm:spec_decode_num_draft_tokens"].value > 0
        finally:
            llm.llm_engine.shutdown()
    assert results[0] == results[1] == results[2]


def test_sleep_and_wake_up_keep_the_folded_maps(tmp_path) -> None:
    """Level 1 moves the folded maps (buffers) to host memory and back; level 2 loads the
    checkpoint and folds again: the same tokens after either."""
    save_deepseek(tmp_path, *CASES["v3"], cache_head_dim=False)
    llm = LLM(
        str(tmp_path),
        skip_tokenizer_init=True,
        max_model_len=128,
        num_kv_blocks=32,
        enable_sleep_mode=True,
    )
    prompts = [{"prompt_token_ids": list(range(5, 40))}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    try:
        expected = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
        for level in (1, 2):
            llm.sleep(level)
            llm.wake_up()
            runner = llm.llm_engine.engine_core.executor.worker.model_runner
            assert runner.kv_geometry.shares_values
            got = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
            assert got == expected, level
    finally:
        llm.llm_engine.shutdown()
