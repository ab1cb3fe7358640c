"""The GEMVs' L2 prefetch (``prefetch.py``): how a budget becomes spans, and (on a GPU)
that asking the L2 for weights changes no result."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, ON_GPU

from pagedlm_cuda.kernels import prefetch
from pagedlm_cuda.kernels.gemv import GemvConfig, gemv
from pagedlm_cuda.kernels.gguf_gemv import gguf_gemv, pack_blocks


@pytest.fixture
def budget(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def set_megabytes(megabytes: float) -> None:
        monkeypatch.setenv(prefetch.PREFETCH_ENV, str(megabytes))

    return set_megabytes


def test_the_budget_is_spread_over_rows_in_aligned_spans(budget) -> None:
    budget(24)
    # q/k/v of llama-3-8b: 4 KB of each 8 KB row after the first 2 KB slice, one
    # 256-byte span per thread of a 16-row, 8-warp program.
    assert prefetch.prefetch_spans(6144, 4096, 1024, 8192, 2, 0, 16, 8) == (16, 128)
    # A row's share below the spans a program could issue: fewer, larger spans.
    spans, columns = prefetch.prefetch_spans(28672, 4096, 256, 8192, 2, 0, 8, 4)
    assert (spans, columns * 2 % 16) == (2, 0) and spans * columns * 2 <= 24 * 2**20 // 28672
    # Never past the row's end.
    spans, columns = prefetch.prefetch_spans(16, 4096, 1024, 8192, 2, 0, 16, 8)
    assert spans * columns == 4096 - 1024


@pytest.mark.parametrize(
    "args",
    [
        (6144, 4096, 1024, 8192, 2, 8, 16, 8),  # a base off the 16-byte grid
        (6144, 4100, 1024, 8200, 2, 0, 16, 8),  # rows off it
        (6144, 4096, 1001, 8192, 2, 0, 16, 8),  # the first span off it
    ],
)
def test_no_prefetch_where_spans_would_be_unaligned(budget, args) -> None:
    budget(24)
    assert prefetch.prefetch_spans(*args)[1] == 0


def test_no_prefetch_without_a_budget_or_under_the_interpreter(budget, monkeypatch) -> None:
    budget(0)
    assert prefetch.prefetch_spans(6144, 4096, 1024, 8192, 2, 0, 16, 8)[1] == 0
    budget(24)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert prefetch.prefetch_spans(6144, 4096, 1024, 8192, 2, 0, 16, 8)[1] == 0


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="the prefetch is inline PTX (no interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_results_do_not_change_with_a_prefetch(budget, dtype, gated: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    weight = (torch.randn(2056, 4096, device=DEVICE) / 64).to(dtype)
    scale = torch.rand(2056, device=DEVICE) if dtype != torch.bfloat16 else None
    runs = []
    for megabytes in (0, 4, 64):
        budget(megabytes)
        runs.append(gemv(x, weight, weight_scale=scale, silu_and_mul=gated))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="the prefetch is inline PTX (no interpreter)")
@pytest.mark.parametrize("config", [GemvConfig(8, 512, 1, 3), GemvConfig(8, 512, 1, 3, 4)])
def test_gguf_gemv_results_do_not_change_with_a_prefetch(budget, config) -> None:
    torch.manual_seed(0)
    n, k = 1032, 4096
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device=DEVICE)
    scales = torch.rand(n, k // 32, device=DEVICE).half().float()
    packed = pack_blocks(codes, scales, -8 * scales, torch.device(DEVICE))
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    runs = []
    for megabytes in (0, 4, 64):
        budget(megabytes)
        runs.append(gguf_gemv(x, packed, config=config))
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
