"""End-to-end parity with transformers for the model zoo (fp32, CPU, tiny random checkpoints).

Greedy token ids over a batch of mixed-length prompts must be identical, and prompt
logprobs within 1e-4. The windowed architectures use a 16-token window, so most prompts
and every generation run far past it.
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tiny_checkpoints import hf_greedy, hf_logits, load_hf_model

PROMPT_LENS = [1, 3, 17, 40, 90, 130]
NEW_TOKENS = 24
PHI3_ORIGINAL_MAX = 64
"""conftest's tiny Phi-3 pretraining length (checked against the checkpoint below)."""
# LongRoPE: pagedlm uses the long factors for every position when max_model_len exceeds
# the pretraining length, the short ones otherwise; transformers switches per sequence
# (see rotary_scaled.longrope_table). Both agree for prompts past the pretraining length,
# and for sequences that stay within it when max_model_len does too.
CASES = {
    "gemma2": ({}, PROMPT_LENS),
    "gemma3": ({}, PROMPT_LENS),
    "phi3_longrope": ({}, [PHI3_ORIGINAL_MAX + 1, 90, 130, 200]),
    "phi3_longrope_short": (
        {"max_model_len": PHI3_ORIGINAL_MAX},
        [1, 3, 17, PHI3_ORIGINAL_MAX - NEW_TOKENS],
    ),
    "mixtral": ({}, PROMPT_LENS),
    "qwen3_moe": ({}, PROMPT_LENS),
    "gpt2": ({}, PROMPT_LENS),
    "mistral_window": ({}, PROMPT_LENS),
}


def _prompts(vocab_size: int, lens: list[int]) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]


def _hf_reference(path, prompts: list[list[int]]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations and the prompts' log-softmax rows [len - 1, vocab]."""
    model = load_hf_model(path)
    logprobs = [torch.log_softmax(hf_logits(model, ids)[:-1], dim=-1) for ids in prompts]
    return hf_greedy(model, prompts, NEW_TOKENS), logprobs


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_prompt_logprobs_match_transformers(tiny_checkpoint, case):
    path = tiny_checkpoint(case.removesuffix("_short"))
    llm_kwargs, prompt_lens = CASES[case]
    llm = LLM(str(path), skip_tokenizer_init=True, **llm_kwargs)
    arch = llm.llm_engine.config.model.arch
    if "phi3" in case:
        assert arch.raw["original_max_position_embeddings"] == PHI3_ORIGINAL_MAX
    prompts = _prompts(arch.vocab_size, prompt_lens)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected_tokens, expected_logprobs = _hf_reference(path, prompts)

    assert [o.outputs[0].token_ids for o in outs] == expected_tokens
    for prompt, out, reference in zip(prompts, outs, expected_logprobs, strict=True):
        assert out.prompt_logprobs[0] is None
        got = torch.tensor(
            [out.prompt_logprobs[pos][prompt[pos]].logprob for pos in range(1, len(prompt))]
        )
        want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
