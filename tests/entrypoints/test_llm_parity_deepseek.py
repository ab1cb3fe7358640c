"""End-to-end parity with transformers for DeepSeek-V2/V3 through ``LLM`` (fp32, CPU, tiny
random checkpoints of ``test_zoo_models_deepseek``): greedy token ids over a batch of
mixed-length prompts identical, prompt logprobs within 1e-4.

The checkpoints keep the config.json transformers writes (head_dim = qk_rope_head_dim);
the KV cache's head size comes from qk_nope + qk_rope all the same.
"""

from __future__ import annotations

import random

import pytest
import torch

from model_executor.test_zoo_models_deepseek import CASES, KEY_HEAD_DIM, MLA, save_deepseek
from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.layers.attention import KVGeometry
from tiny_checkpoints import hf_greedy, hf_logits

PROMPT_LENS = [1, 3, 17, 40, 90]
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["v2_lite", "v3"])
def reference(request, tmp_path_factory):
    """A case's checkpoint, prompts, and transformers' greedy tokens and prompt logprobs
    (built once for both cache forms)."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = save_deepseek(path, *CASES[request.param], cache_head_dim=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(hf_model.config.vocab_size) for _ in range(n)] for n in PROMPT_LENS]
    logprobs = []
    for prompt in prompts:
        want = torch.log_softmax(hf_logits(hf_model, prompt)[:-1], dim=-1)
        logprobs.append(
            want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        )
    return path, prompts, hf_greedy(hf_model, prompts, NEW_TOKENS), logprobs


@pytest.mark.parametrize("form", ["latent", "expanded"])
def test_greedy_and_prompt_logprobs_match_transformers(reference, monkeypatch, form: str) -> None:
    """By default the cache holds one latent vector per token and layer (the CPU backend
    has latent attention); ``PAGEDLM_MLA_DISABLE=1`` keeps every head's expanded keys and
    values. Both give transformers' tokens, and prompt logprobs within 1e-4 (5e-3 on a GPU,
    whose kernels take float32 dots in TF32)."""
    path, prompts, expected_tokens, expected_logprobs = reference
    if form == "expanded":
        monkeypatch.setenv("PAGEDLM_MLA_DISABLE", "1")
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        max_model_len=128,
    )
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    latent_width = MLA["kv_lora_rank"] + MLA["qk_rope_head_dim"]
    if form == "latent":
        assert runner.kv_geometry == KVGeometry(1, latent_width, shares_values=True)
    else:
        assert runner.kv_geometry == KVGeometry(MLA["num_key_value_heads"], KEY_HEAD_DIM)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in outs] == expected_tokens
    for prompt, out, want in zip(prompts, outs, expected_logprobs, strict=True):
        got = torch.tensor(
            [out.prompt_logprobs[pos][prompt[pos]].logprob for pos in range(1, len(prompt))]
        )
        torch.testing.assert_close(
            got, want, atol=1e-4 if runner.device.type == "cpu" else 5e-3, rtol=0
        )


def _greedy_run(path, **parallel) -> list:
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        max_model_len=128,
        num_kv_blocks=64,
        **parallel,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
        prompts = [[5, 9, 2, 77, 31, 8, 100, 3, 3, 64], [42], list(range(7, 47))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [
        (
            o.outputs[0].token_ids,
            [o.prompt_logprobs[i][t].logprob for i, t in enumerate(o.prompt_token_ids) if i],
        )
        for o in outs
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [
        dict(tensor_parallel_size=2),
        dict(pipeline_parallel_size=2),
        dict(tensor_parallel_size=2, pipeline_parallel_size=2),
    ],
    ids=["tp2", "pp2", "tp2xpp2"],
)
def test_parallel_layouts_match_one_worker(tmp_path, parallel) -> None:
    """V3 (dense first layer, MoE layers, latent q) split over worker processes: heads
    across tensor-parallel ranks, layers across pipeline stages."""
    save_deepseek(tmp_path, *CASES["v3"], cache_head_dim=False)
    expected = _greedy_run(tmp_path)
    got = _greedy_run(tmp_path, **parallel)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, expected, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=0
        )
