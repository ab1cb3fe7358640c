"""The Triton attention backend (and the CUDA platform) pass the conformance kit.

On CPU the kernels run in Triton's interpreter, which is slow: by default only the checks
the kernels' own tests do not cover (graph replay with padding rows, same-step reads of
blocks being written), with one block size and head shape; every attention check under
``-m slow``. On a GPU (``-m cuda``) the whole kit runs on the CUDA platform: platform,
fused sampler, every attention check at the default sizes, and greedy parity with the CPU.
"""

from __future__ import annotations

import pytest
import torch

from plugin_kit import kit_checkpoints
from triton_setup import load_triton_env

ON_GPU = load_triton_env().ON_GPU

from pagedlm.testing import (  # noqa: E402
    BACKEND_CHECKS,
    PLATFORM_CHECKS,
    TINY_MODELS,
    AttentionTarget,
    HeadShape,
    NotApplicable,
    check_fused_sampler,
    check_greedy_parity,
)
from pagedlm_cuda.attention import TritonAttentionBackend  # noqa: E402

INTERPRETED = AttentionTarget(
    TritonAttentionBackend, block_sizes=(16,), head_shapes=(HeadShape(4, 2, 32),)
)
FAST_ON_CPU = ("kv_cache_shape", "write_before_read", "graph_replay")
on_cpu = pytest.mark.skipif(ON_GPU, reason="the GPU runs the whole kit (-m cuda)")


@on_cpu
@pytest.mark.parametrize("check", FAST_ON_CPU)
def test_triton_backend_interpreted(check: str) -> None:
    BACKEND_CHECKS[check](INTERPRETED)


@on_cpu
@pytest.mark.slow
@pytest.mark.parametrize("check", [c for c in BACKEND_CHECKS if c not in FAST_ON_CPU])
def test_triton_backend_interpreted_slow(check: str) -> None:
    BACKEND_CHECKS[check](INTERPRETED)


@on_cpu
@pytest.mark.slow
def test_gumbel_sampler_interpreted() -> None:
    from pagedlm_cuda.kernels.sampling import gumbel_sample

    check_fused_sampler(gumbel_sample, torch.device("cpu"), rows_per_temperature=256)


def _cuda_platform():
    from pagedlm.plugins.registry import select_platform

    return select_platform("cuda")


def _run(check, *args) -> None:
    try:
        check(*args)
    except NotApplicable as exc:
        pytest.skip(str(exc))


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("check", list(PLATFORM_CHECKS))
def test_cuda_platform(check: str) -> None:
    _run(PLATFORM_CHECKS[check], _cuda_platform())


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("check", list(BACKEND_CHECKS))
def test_triton_backend_on_gpu(check: str, dtype: torch.dtype) -> None:
    target = AttentionTarget.for_platform(_cuda_platform(), TritonAttentionBackend, dtype=dtype)
    _run(BACKEND_CHECKS[check], target)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("arch", list(TINY_MODELS))
def test_cuda_greedy_parity(arch: str, tmp_path_factory) -> None:
    _run(check_greedy_parity, _cuda_platform(), arch, kit_checkpoints(tmp_path_factory))
