"""The few-row GEMM (2 to 128 rows on the warpgroup MMA, ``kernels/gemm_rows.py``) against
a float64 reference, its row independence and split-K, and the linear-layer routing that
sends it 2 to ``PAGEDLM_GEMM_ROWS_MAX`` rows of a 16-bit layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, rel_error, tolerance

from pagedlm.model_executor.layers.linear import RowParallelLinear
from pagedlm_cuda.fused_layers import install_fused_kernels
from pagedlm_cuda.kernels.gemm_rows import (
    GemmRowsConfig,
    beats_cublas,
    gemm_rows,
    gemm_rows_config,
)

# Rows past the last 64-row block, columns not a whole number of slices (no split then),
# and columns that split into whole slices.
SHAPES = [(100, 512), (130, 600), (64, 1024), (200, 2048)]
TILES = [None, GemmRowsConfig(64, 128, 4, 3, 4), GemmRowsConfig(128, 128, 8, 4, 2),
         GemmRowsConfig(64, 256, 4, 3)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("config", TILES, ids=str)
@pytest.mark.parametrize("m", [5, 24])
def test_gemm_rows_matches_float64(dtype, shape: tuple[int, int], config, m: int) -> None:
    n, k = shape
    torch.manual_seed(n + k)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out = gemm_rows(x, weight, bias, config)
    ref = x.double() @ weight.double().T + bias.double()
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_error(out, ref) < tolerance(dtype)


@pytest.mark.parametrize("config", [GemmRowsConfig(64, 128, 4, 3, 4), None], ids=str)
def test_a_rows_result_depends_on_its_own_values_only(config) -> None:
    """The same row in 2, 5, 16, 40 or 128 rows, next to other values: the same bits
    (padded rows are zeros and rows never mix, whatever the MMA's narrow side; the split
    parts are summed in split order)."""
    torch.manual_seed(0)
    n, k = 130, 1024
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
    row = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    results = []
    for rows in (2, 5, 16, 40, 128):
        x = torch.cat([torch.randn(rows - 1, k, device=DEVICE).to(torch.bfloat16), row])
        results.append(gemm_rows(x, weight, None, config)[-1])
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize("n", [2, 130, 1030])
@pytest.mark.parametrize("config", [None, GemmRowsConfig(64, 128, 4, 3, 2)], ids=str)
@pytest.mark.parametrize("m", [6, 33])
def test_silu_and_mul_epilogue_is_the_two_kernels(n: int, config, m: int) -> None:
    """``silu_and_mul=True``: exactly the plain result followed by the activation kernel
    (row counts past a tile's half, split and unsplit)."""
    from pagedlm_cuda.kernels import silu_and_mul

    torch.manual_seed(n)
    k = 256
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    fused = gemm_rows(x, weight, bias, config, silu_and_mul=True)
    assert fused.shape == (m, n // 2)
    assert torch.equal(fused, silu_and_mul(gemm_rows(x, weight, bias, config)))
    with pytest.raises(ValueError, match="even row count"):
        gemm_rows(x, weight[:-1], None, config, silu_and_mul=True)


def test_gemm_rows_reads_strided_rows_and_writes_all_of_them() -> None:
    torch.manual_seed(1)
    k = 256
    wide = torch.randn(16, 2 * k, device=DEVICE).to(torch.float16)
    x = wide[:, :k]  # rows 2k apart
    weight = (torch.randn(72, k, device=DEVICE) / k**0.5).to(torch.float16)
    ref = x.double() @ weight.double().T
    assert rel_error(gemm_rows(x, weight), ref) < tolerance(torch.float16)


def test_gemm_rows_rejects_what_it_cannot_compute() -> None:
    weight = torch.randn(64, 32, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 128 rows"):
        gemm_rows(torch.randn(129, 32, device=DEVICE).to(torch.bfloat16), weight)
    with pytest.raises(ValueError, match="features"):
        gemm_rows(torch.randn(2, 16, device=DEVICE).to(torch.bfloat16), weight)
    with pytest.raises(ValueError, match="one dtype"):
        gemm_rows(torch.randn(2, 32, device=DEVICE), weight)


def test_default_tiles_follow_the_row_count() -> None:
    assert gemm_rows_config(4096, 4096).split_k == 4  # few row blocks: split
    assert gemm_rows_config(6144, 4096) == GemmRowsConfig(64, 256, 4, 3)
    assert gemm_rows_config(128256, 4096) == GemmRowsConfig(64, 128, 4, 4)
    assert gemm_rows_config(1024, 2048, rows=32) == GemmRowsConfig(64, 128, 4, 4, 4)
    assert gemm_rows_config(4096, 1024, rows=32).split_k == 1  # few columns: no split
    assert gemm_rows_config(4096, 14336, rows=24) == GemmRowsConfig(64, 128, 4, 3, 4)
    assert gemm_rows_config(28672, 4096, rows=32).stages == 3  # more programs than SMs
    assert gemm_rows_config(6144, 4096, rows=32).stages == 4  # 96 programs: one per SM
    assert gemm_rows_config(6144, 4096, rows=128).block_k == 64  # fits the shared memory


def test_an_lm_head_keeps_cublas_above_16_rows() -> None:
    """Where cuBLAS measured faster (qwen3-0.6b's LM head at 24-32 rows)."""
    assert beats_cublas(16, 151936) and not beats_cublas(17, 151936)
    assert beats_cublas(32, 6144)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_layers_route_few_16_bit_rows_to_it(dtype, monkeypatch) -> None:
    """2 to 32 rows of a 16-bit layer go to ``gemm_rows`` (up to ``PAGEDLM_GEMM_ROWS_MAX``
    when set); 33 rows, float32 layers and ``PAGEDLM_GEMM_ROWS=0`` to ``F.linear``; every
    route computes the layer."""
    import pagedlm_cuda.fused_layers as fused_layers
    import pagedlm_cuda.kernels.gemm_rows as module

    torch.manual_seed(2)
    layer = RowParallelLinear(64, 72, bias=True).to(DEVICE)
    with torch.no_grad():
        layer.weight.normal_(0, 0.1)
        layer.bias.normal_()
    layer = layer.to(dtype)
    install_fused_kernels(torch.nn.Sequential(layer))
    calls = []
    original = module.gemm_rows
    monkeypatch.setattr(module, "gemm_rows", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    fused_layers._gemm_rows_on.cache_clear()
    for rows in (2, 16, 32, 33):
        x = torch.randn(rows, 64, device=DEVICE).to(dtype)
        expected = F.linear(x.double(), layer.weight.double(), layer.bias.double())
        assert rel_error(layer.apply_linear(x), expected) < tolerance(dtype)
    # On a GPU only Hopper and later take it (where it was measured).
    routed = [2, 16, 32] if dtype == torch.bfloat16 and fused_layers._gemm_rows_on() else []
    assert calls == routed
    monkeypatch.setenv(fused_layers.GEMM_ROWS_ENV, "0")
    fused_layers._gemm_rows_on.cache_clear()
    try:
        layer.apply_linear(torch.randn(3, 64, device=DEVICE).to(dtype))
        assert calls == routed
    finally:
        monkeypatch.delenv(fused_layers.GEMM_ROWS_ENV)
        fused_layers._gemm_rows_on.cache_clear()
    monkeypatch.setenv(fused_layers.GEMM_ROWS_MAX_ENV, "40")
    fused_layers._gemm_rows_max.cache_clear()
    try:
        for rows in (17, 40, 41):
            layer.apply_linear(torch.randn(rows, 64, device=DEVICE).to(dtype))
        assert calls == routed + ([17, 40] if routed else [])
        monkeypatch.setenv(fused_layers.GEMM_ROWS_MAX_ENV, "129")
        fused_layers._gemm_rows_max.cache_clear()
        if routed:
            with pytest.raises(ValueError, match="from 2 to 128"):
                layer.apply_linear(torch.randn(3, 64, device=DEVICE).to(dtype))
    finally:
        monkeypatch.delenv(fused_layers.GEMM_ROWS_MAX_ENV)
        fused_layers._gemm_rows_max.cache_clear()
