"""Every supported architecture (tiny random fp32 checkpoints, MoE included) gives one
worker's greedy tokens and prompt logprobs under TP=2, PP=2 and TP=2 x PP=2; and the Ray
executor does for TP=2 on a local Ray cluster. Slow: each case starts 2-4 worker processes."""

from __future__ import annotations

import importlib.util

import pytest
from parity import (
    assert_same_run,
    greedy_run,
    make_llm,
    one_worker_run,
    processes_gone,
    run_and_stop,
)

pytestmark = pytest.mark.slow

ARCHITECTURES = [
    "llama",
    "llama3",
    "llama_tied",
    "mistral",
    "mistral_window",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3_longrope",
    "mixtral",
    "qwen3_moe",
    "gpt2",
]
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pp2": dict(pipeline_parallel_size=2),
    "tp2xpp2": dict(tensor_parallel_size=2, pipeline_parallel_size=2),
}

_references: dict[str, list] = {}


def _reference(tiny_checkpoint, arch: str) -> list:
    if arch not in _references:
        _references[arch] = one_worker_run(tiny_checkpoint(arch))
    return _references[arch]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layout_matches_one_worker(tiny_checkpoint, arch, layout):
    expected = _reference(tiny_checkpoint, arch)
    outputs, pids = run_and_stop(tiny_checkpoint(arch), **LAYOUTS[layout])
    assert_same_run(outputs, expected)
    assert processes_gone(pids)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="Ray is not installed")
def test_ray_executor_tensor_parallel(tiny_checkpoint, llama_reference):
    import ray

    from pagedlm.executor.ray_executor import RayExecutor

    llm = make_llm(
        tiny_checkpoint("llama"), tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    try:
        assert isinstance(llm.llm_engine.engine_core.executor, RayExecutor)
        assert_same_run(greedy_run(llm), llama_reference)
    finally:
        llm.llm_engine.shutdown()
    assert not ray.is_initialized()  # the cluster it started went down with it
