"""End-to-end parity with transformers for Llama variants (fp32, CPU, tiny random checkpoints).

Through ``pagedlm.LLM`` (the CPU platform's kernels installed, continuous batching, the
paged cache): greedy token ids over a batch of mixed-length prompts must be identical to
transformers' ``generate``, and prompt logprobs within 1e-4. Granite's multipliers,
OLMo 3's 8-token windows (prompts and generations run far past them), SmolLM3's NoPE layer
beside a rotary one, and Qwen2-MoE's shared expert.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tiny_checkpoints import hf_greedy, hf_logits, save_random_model

PROMPT_LENS = [1, 3, 17, 40, 70]
NEW_TOKENS = 24
WINDOW = 8
TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

CASES = {
    "granite": (
        "GraniteConfig",
        {
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.4,
            "attention_multiplier": 0.1,
            "logits_scaling": 4.0,
        },
    ),
    "olmo3": (
        "Olmo3Config",
        {
            **TOKENS,
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "smollm3": ("SmolLM3Config", {**TOKENS, "no_rope_layers": [1, 0]}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "mlp_only_layers": [1],
        },
    ),
}


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_prompt_logprobs_match_transformers(tmp_path: Path, case: str) -> None:
    hf_model = save_random_model(tmp_path, *CASES[case])
    llm = LLM(str(tmp_path), skip_tokenizer_init=True)
    arch = llm.llm_engine.config.model.arch
    assert arch.architecture == type(hf_model).__name__
    prompts = _prompts(arch.vocab_size)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.shutdown()

    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, prompts, NEW_TOKENS)
    for prompt, out in zip(prompts, outs, strict=True):
        reference = torch.log_softmax(hf_logits(hf_model, prompt)[:-1], dim=-1)
        got = torch.tensor(
            [out.prompt_logprobs[pos][prompt[pos]].logprob for pos in range(1, len(prompt))]
        )
        want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
