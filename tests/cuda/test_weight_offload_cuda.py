"""``cpu_offload_gb`` on the GPU: the CUDA platform's views of pinned host memory pass the
kit's check, and a model with part of its weights in host memory (read by the kernels in
place, under CUDA graphs) gives the tokens it gives on the device, holding less device
memory. Run on the lent GPU: ``python -m pytest -q -m cuda tests/cuda/test_weight_offload_cuda.py``."""

from __future__ import annotations

import gc

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.benchmarks.shapes import resolve_model
from pagedlm.testing.platform_checks import check_host_mapping
from pagedlm_cuda.platform import CudaPlatform

pytestmark = pytest.mark.cuda
PROMPTS = [{"prompt_token_ids": list(range(1, 65))}, {"prompt_token_ids": [7] * 5}]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def test_cuda_maps_pinned_host_memory():
    check_host_mapping(CudaPlatform())


def _run(batch: list, **kwargs):
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM(
        resolve_model("qwen3-0.6b"),
        load_format="dummy",
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=1024,
        num_kv_blocks=256,
        **kwargs,
    )
    try:
        tokens = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        offload = llm.llm_engine.engine_core.executor.worker.model_runner.weight_offload
        offloaded = offload.offloaded_bytes if offload is not None else 0
        return tokens, offloaded, torch.cuda.memory_allocated()
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("batch", [PROMPTS[:1], PROMPTS], ids=["batch1", "batch2"])
def test_offloaded_weights_give_the_same_tokens(batch):
    expected, none, allocated = _run(batch)
    assert none == 0
    tokens, offloaded, allocated_offloaded = _run(batch, cpu_offload_gb=0.5)
    assert 0.5 * 2**30 <= offloaded < 0.55 * 2**30  # the last tensor may pass the budget
    assert allocated_offloaded < allocated - 0.4 * 2**30
    assert tokens == expected
