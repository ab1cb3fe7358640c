"""The multiprocess executor on one GPU: its worker process gives the in-process worker's
tokens and prompt logprobs exactly (same kernels, same batches, CUDA graphs captured in the
worker), and shutting down leaves no process. Runs on the lent single GPU with ``-m cuda``;
its speed is ``python -m pagedlm.benchmarks.executor_overhead``'s."""

from __future__ import annotations

import os

import pytest

from pagedlm import LLM, SamplingParams

pytestmark = pytest.mark.cuda
PROMPTS = [[5, 9, 2, 77, 31, 8, 100, 3, 3, 64], [42], list(range(7, 120))]
PARAMS = SamplingParams(max_tokens=48, temperature=0, prompt_logprobs=0, ignore_eos=True)


def _run(path, backend: str):
    llm = LLM(
        str(path),
        skip_tokenizer_init=True,
        max_model_len=256,
        gpu_memory_utilization=0.3,
        distributed_executor_backend=backend,
    )
    executor = llm.llm_engine.engine_core.executor
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        return outputs, list(getattr(executor, "worker_pids", []))
    finally:
        llm.llm_engine.shutdown()


def test_worker_process_matches_the_in_process_worker(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    expected, _ = _run(path, "uni")
    actual, pids = _run(path, "mp")
    assert len(pids) == 1
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
    for got, want in zip(actual, expected, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.prompt_logprobs == want.prompt_logprobs
