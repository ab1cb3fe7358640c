"""Shared by the distributed tests: one greedy run with prompt logprobs, and its comparison."""

from __future__ import annotations

import os
from typing import Any

from pagedlm import LLM, SamplingParams
from pagedlm.outputs import RequestOutput

PROMPTS = [[5, 9, 2, 77, 31, 8, 100, 3, 3, 64], [42], list(range(7, 47))]
NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-5


def make_llm(path: Any, **parallel: Any) -> LLM:
    return LLM(
        str(path),
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        max_model_len=128,
        max_num_seqs=8,
        **parallel,
    )


def greedy_run(llm: LLM) -> list[RequestOutput]:
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0, prompt_logprobs=0, ignore_eos=True
    )
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return llm.generate(prompts, params, use_tqdm=False)


def run_and_stop(path: Any, **parallel: Any) -> tuple[list[RequestOutput], list[int]]:
    """A greedy run on a fresh engine with worker processes, and their pids (the engine
    is shut down before this returns)."""
    llm = make_llm(path, **parallel)
    executor = llm.llm_engine.engine_core.executor
    try:
        return greedy_run(llm), list(executor.worker_pids)
    finally:
        llm.llm_engine.shutdown()


def prompt_logprobs(output: RequestOutput) -> list[float]:
    """The logprob of every prompt token after the first (teacher-forced)."""
    values = []
    for position, token_id in enumerate(output.prompt_token_ids[1:], start=1):
        values.append(output.prompt_logprobs[position][token_id].logprob)
    return values


def one_worker_run(path: Any) -> list[RequestOutput]:
    """The reference: a greedy run on an engine with one worker in this process."""
    llm = make_llm(path)
    try:
        return greedy_run(llm)
    finally:
        llm.llm_engine.shutdown()


def assert_same_run(
    actual: list[RequestOutput],
    expected: list[RequestOutput],
    tolerance: float = LOGPROB_TOLERANCE,
) -> float:
    """Identical greedy tokens; prompt logprobs within ``tolerance`` (looser where ranks
    add quantized layers' partial sums in another order). Returns the largest difference."""
    assert [o.outputs[0].token_ids for o in actual] == [o.outputs[0].token_ids for o in expected]
    worst = 0.0
    for got, want in zip(actual, expected, strict=True):
        for a, b in zip(prompt_logprobs(got), prompt_logprobs(want), strict=True):
            assert abs(a - b) <= tolerance, (a, b)
            worst = max(worst, abs(a - b))
    return worst


def processes_gone(pids: list[int]) -> bool:
    return not any(os.path.exists(f"/proc/{pid}") for pid in pids)
