"""Architectures forced through the Transformers modeling backend against transformers
itself (tiny random fp32 checkpoints): greedy tokens equal, prompt logprobs within 1e-4.

Each brings something the backend must carry from transformers' own modules: Qwen3's
per-head q/k norms, Gemma 2's scaled embedding, (1 + weight) norms, attention and final
logit soft caps and alternating sliding windows, Phi-3's packed q/k/v and gate/up, OLMo 2's
whole-projection q/k norms after the projections, Cohere's LayerNorm and logit scale,
Granite's multipliers, StarCoder2's biased GELU MLP, GPT-NeoX's interleaved q/k/v and
parallel residual. The engine chunks the prompts (8-token steps over 4-token blocks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tiny_checkpoints import hf_greedy, hf_logits, random_prompts, save_random_model

NEW_TOKENS = 5
LENS = [1, 9, 30, 4]
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
CASES = {
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "gemma2": (
        "Gemma2Config",
        {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 30.0,
         "final_logit_softcapping": 20.0, "query_pre_attn_scalar": 16, **IDS},
    ),
    "phi3": ("Phi3Config", {**IDS}),
    "olmo2": ("Olmo2Config", {**IDS}),
    "cohere": ("CohereConfig", {"logit_scale": 0.5, **IDS}),
    "granite": (
        "GraniteConfig",
        {"embedding_multiplier": 2.0, "residual_multiplier": 0.5, "logits_scaling": 4.0,
         "attention_multiplier": 0.2},
    ),
    "starcoder2": ("Starcoder2Config", {**IDS}),
    # GPT-NeoX attends with every head as kv head: config.json must not say otherwise.
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.5, "num_key_value_heads": 4, **IDS}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_forced_through_the_backend_matches_transformers(case: str, tmp_path: Path) -> None:
    config_class, overrides = CASES[case]
    hf_model = save_random_model(tmp_path, config_class, overrides)
    prompts = random_prompts(LENS)
    llm = LLM(
        str(tmp_path),
        model_impl="transformers",
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        block_size=4,
        max_num_batched_tokens=8,
        num_kv_blocks=64,
    )
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == hf_greedy(
        hf_model, prompts, NEW_TOKENS
    )
    for output, prompt in zip(outputs, prompts, strict=True):
        if len(prompt) < 2:
            continue
        want = torch.log_softmax(hf_logits(hf_model, prompt), -1)[:-1]
        want = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        got = torch.tensor([d[t].logprob for d, t in zip(output.prompt_logprobs[1:], prompt[1:])])
        # GPU kernels take float32 dots in TF32 (seen: 1.0e-3 on an H100)
        atol = 1e-4 if llm.llm_engine.config.platform == "cpu" else 2e-3
        torch.testing.assert_close(got, want, atol=atol, rtol=0)


def test_a_config_whose_head_counts_the_model_ignores_is_refused(tmp_path: Path) -> None:
    """GPT-NeoX ignores num_key_value_heads; a config.json that gives one would size the
    KV cache for heads the model does not have: refused, naming the fix."""
    save_random_model(tmp_path, "GPTNeoXConfig", {"num_key_value_heads": 2, **IDS})
    params = SamplingParams(max_tokens=2)
    # Refused at the first forward: the GPU's memory profiling at start-up, the CPU's step.
    with pytest.raises(ValueError, match=r"4 query and 4 key/value heads.*sized for 4 and 2"):
        llm = LLM(str(tmp_path), model_impl="transformers", dtype="float32",
                  skip_tokenizer_init=True, max_model_len=64, num_kv_blocks=16)  # fmt: skip
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)


def test_experts_saved_one_by_one_are_refused_by_name(tmp_path: Path) -> None:
    """transformers merges Qwen2-MoE's per-expert tensors when it loads; the backend does
    not, and says so."""
    save_random_model(
        tmp_path, "Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\..*one of those transformers merges"):
        LLM(str(tmp_path), model_impl="transformers", dtype="float32", skip_tokenizer_init=True,
            max_model_len=64, num_kv_blocks=16)  # fmt: skip
