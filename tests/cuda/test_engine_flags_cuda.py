"""enforce_eager and gpu_memory_utilization on the GPU, end to end through ``LLM``.
Run on the lent GPU: ``python -m pytest -q -m cuda tests/cuda/test_engine_flags_cuda.py``."""

from __future__ import annotations

import gc
import re

import pytest
import torch

from pagedlm import LLM
from pagedlm.benchmarks.shapes import resolve_model

pytestmark = pytest.mark.cuda
GIB = 2**30


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def test_enforce_eager_skips_graph_capture(tiny_checkpoint) -> None:
    path = str(tiny_checkpoint("llama"))
    kwargs = dict(skip_tokenizer_init=True, dtype="bfloat16", num_kv_blocks=64)
    assert _runner(LLM(path, **kwargs)).graph_runner is not None
    eager = LLM(path, enforce_eager=True, **kwargs)
    assert eager.llm_engine.config.model.enforce_eager is True
    assert _runner(eager).graph_runner is None


def _start_up_error(model: str, **kwargs) -> str:
    """The message of the start-up ValueError, with its traceback (which holds the
    half-built engine's weights) already dropped."""
    try:
        LLM(model, **kwargs)
    except ValueError as error:
        return str(error)
    raise AssertionError("LLM(...) started although the KV cache cannot fit")


def test_too_long_max_model_len_says_what_fits_and_the_suggestion_starts() -> None:
    """qwen3-0.6b shape (112 KiB of KV per token in bf16): a fraction that leaves ~2 GiB
    for the KV cache holds ~19k tokens, fewer than its 40960 positions."""
    model = resolve_model("qwen3-0.6b")
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    weights_and_peak = 2.0 * GIB  # 1.2 GiB of weights, the rest for activations
    utilization = round((total - free + weights_and_peak + 2 * GIB) / total, 3)
    kwargs = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_num_batched_tokens=2048,
        gpu_memory_utilization=utilization,
        enforce_eager=True,
    )
    message = _start_up_error(model, max_model_len=40960, **kwargs)
    print(message)
    fits = int(re.search(r"holds (\d+) tokens", message)[1])
    assert 0 < fits < 40960
    assert f"--max-model-len to at most {fits}" in message
    assert "--gpu-memory-utilization to at least" in message
    gc.collect()
    torch.cuda.empty_cache()
    # The suggested length starts (a few blocks of slack for allocator noise between runs).
    llm = LLM(model, max_model_len=fits - 256, **kwargs)
    assert llm.llm_engine.config.scheduler.max_model_len == fits - 256
