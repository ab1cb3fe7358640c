"""Token-for-token parity with transformers on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import random

import pytest

from pagedlm import LLM, SamplingParams
from tiny_checkpoints import hf_greedy, load_hf_model

PROMPT_LENS = [1, 3, 17, 33, 64, 100, 150, 230]
NEW_TOKENS = 32


def _prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]


def _hf_greedy(path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    return hf_greedy(load_hf_model(path), prompts, new_tokens)


def _run(llm: LLM, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _metric(llm: LLM, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


@pytest.mark.parametrize("arch", ["llama", "llama3", "llama_tied", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    llm = LLM(str(path), skip_tokenizer_init=True)
    prompts = _prompts(llm.llm_engine.config.model.arch.vocab_size)
    assert _run(llm, prompts) == _hf_greedy(path, prompts)


@pytest.fixture(scope="module")
def llama_reference(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = _prompts(384)
    return path, prompts, _hf_greedy(path, prompts)


def test_chunked_prefill_keeps_outputs(llama_reference):
    path, prompts, expected = llama_reference
    llm = LLM(str(path), skip_tokenizer_init=True, max_num_batched_tokens=48)
    assert _run(llm, prompts) == expected


def test_preemption_keeps_outputs(llama_reference):
    path, prompts, expected = llama_reference
    # 8 requests need ~60 blocks at full length; 24 blocks force preemption by recompute.
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        num_kv_blocks=24,
        block_size=16,
        disable_log_stats=False,
    )
    assert _run(llm, prompts) == expected
    assert _metric(llm, "pagedlm:num_preemptions") > 0


def test_prefix_cache_hits_keep_outputs(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    rng = random.Random(1)
    shared = [rng.randrange(384) for _ in range(70)]
    prompts = [shared + [rng.randrange(384) for _ in range(n)] for n in (1, 5, 20, 40)]
    expected = _hf_greedy(path, prompts)
    llm = LLM(str(path), skip_tokenizer_init=True, disable_log_stats=False)
    assert _run(llm, prompts) == expected
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == expected
    assert all(o.num_cached_tokens > 0 for o in second)
    assert _metric(llm, "pagedlm:prefix_cache_hits") > 0


def test_cache_salt_isolates_prefix_cache(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint("llama")), skip_tokenizer_init=True)
    prompt = list(range(1, 70))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def cached(salt: str | None) -> int:
        request = {"prompt_token_ids": prompt}
        if salt is not None:
            request["cache_salt"] = salt
        return llm.generate(request, params, use_tqdm=False)[0].num_cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same tokens, other salt: no hit
    assert cached("tenant-a") > 0
    assert cached(None) == 0
    with pytest.raises(ValueError, match="cache_salt"):
        cached("")


def test_priority_needs_its_policy_and_then_orders_requests(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    fcfs = LLM(path, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="priority scheduling is not enabled"):
        fcfs.generate(prompts, params, use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="one per prompt"):
        fcfs.generate(prompts, params, use_tqdm=False, priority=[0])
    same = fcfs.generate(prompts, params, use_tqdm=False, priority=[0, 0])
    del fcfs

    llm = LLM(path, skip_tokenizer_init=True, scheduling_policy="priority", max_num_seqs=1)
    outs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 1])
    # One sequence at a time: the second prompt, more urgent, runs (and ends) first.
    assert outs[1].metrics["finished_time"] < outs[0].metrics["finished_time"]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in same]
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(path, skip_tokenizer_init=True, scheduling_policy="lifo")
