"""End-to-end parity with transformers for the LayerNorm families (fp32, CPU, tiny random
checkpoints) through ``pagedlm.LLM``: the CPU platform's kernels, scheduler and sampler
included.

Greedy token ids over a batch of mixed-length prompts must be identical, and prompt
logprobs within 1e-4. Phi brings an LM head with a bias and partial rotary, GPT-NeoX its
per-head fused q/k/v, Cohere 2 interleaved rotary, a logit scale and a 16-token window
that most prompts and every generation run past.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from pagedlm import LLM, SamplingParams
from tiny_checkpoints import hf_greedy, hf_logits, save_random_model

PROMPT_LENS = [1, 3, 17, 40, 90]
NEW_TOKENS = 24
WINDOW = 16

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.4, "qk_layernorm": True}),
    "gpt_neox": ("GPTNeoXConfig", {"num_key_value_heads": None}),
    "cohere2": (
        "Cohere2Config",
        {
            "sliding_window": WINDOW,
            "layer_types": ["sliding_attention", "full_attention"],
            "logit_scale": 0.5,
        },
    ),
}


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in PROMPT_LENS]


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_and_prompt_logprobs_match_transformers(tmp_path, case):
    hf_model = save_random_model(tmp_path, *CASES[case])
    llm = LLM(str(tmp_path), skip_tokenizer_init=True)
    prompts = _prompts(llm.llm_engine.config.model.arch.vocab_size)
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=1
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf_model, prompts, NEW_TOKENS)
    for prompt, out in zip(prompts, outs, strict=True):
        reference = torch.log_softmax(hf_logits(hf_model, prompt)[:-1], dim=-1)
        got = torch.tensor(
            [out.prompt_logprobs[pos][prompt[pos]].logprob for pos in range(1, len(prompt))]
        )
        want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:], dtype=torch.long)]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
