"""Seeded sampling is independent of what else is in the batch; seeds matter."""

from __future__ import annotations

import random

from pagedlm import LLM, SamplingParams


def _prompts(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"prompt_token_ids": [rng.randrange(384) for _ in range(rng.randint(3, 40))]}
        for _ in range(n)
    ]


def test_seed_reproducible_across_batches(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True)
    target = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=42)
    alone = llm.generate(target, params, use_tqdm=False)[0].outputs[0].token_ids
    noise = SamplingParams(temperature=1.2, max_tokens=30, ignore_eos=True)
    batch = _prompts(5, 1)
    mixed = llm.generate(
        batch[:2] + [target] + batch[2:], [noise] * 2 + [params] + [noise] * 3, use_tqdm=False
    )
    assert mixed[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=43)
    assert llm.generate(target, other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_samples_differ_and_share_prompt_blocks(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True, disable_log_stats=False)
    prompt = {"prompt_token_ids": list(range(1, 50))}
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, ignore_eos=True, seed=7)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    samples = {tuple(c.token_ids) for c in out.outputs}
    assert len(samples) > 1
    # Children 1..3 reuse child 0's three full prompt blocks (48 of the 49 prompt tokens).
    hits = sum(m.value for m in llm.get_metrics() if m.name == "pagedlm:prefix_cache_hits")
    assert hits >= 3 * 48
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
