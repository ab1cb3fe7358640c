"""Batch-invariant mode on the GPU (bf16, CUDA graphs on): the CPU test's 32 requests
alone, in a batch of 256 and with chunked prefill give bitwise-identical logprobs, with a
bf16 and with an FP8 KV cache. Run on the lent GPU with ``-m cuda``."""

from __future__ import annotations

import pytest

from pagedlm import LLM
from test_batch_invariant import (
    BATCH,
    FILLER,
    FILLER_PARAMS,
    NUM_REQUESTS,
    PARAMS,
    PROMPTS,
    _results,
)
from tiny_checkpoints import save_random_model

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("bi-cuda-llama")
    save_random_model(path, "LlamaConfig", {})
    return str(path)


def _llm(checkpoint: str, kv_cache_dtype: str, **kwargs) -> LLM:
    return LLM(
        model=checkpoint,
        skip_tokenizer_init=True,
        platform="cuda",
        dtype="bfloat16",
        max_model_len=128,
        enable_prefix_caching=False,
        num_kv_blocks=2048,
        batch_invariant=True,
        kv_cache_dtype=kv_cache_dtype,
        **kwargs,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_alone_batched_and_chunked_agree_bitwise_on_gpu(checkpoint, kv_cache_dtype):
    big = _llm(checkpoint, kv_cache_dtype, max_num_seqs=BATCH, max_num_batched_tokens=8192)
    alone = [_results(big, [p], [sp])[0] for p, sp in zip(PROMPTS, PARAMS)]
    batched = _results(big, PROMPTS + FILLER, PARAMS + FILLER_PARAMS)[:NUM_REQUESTS]
    del big
    small = _llm(checkpoint, kv_cache_dtype, max_num_seqs=64, max_num_batched_tokens=16)
    chunked = _results(small, PROMPTS + FILLER[:32], PARAMS + FILLER_PARAMS[:32])[:NUM_REQUESTS]
    assert batched == alone
    assert chunked == alone
