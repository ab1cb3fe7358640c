"""The few-row tensor-core GEMV against a float64 reference, its row independence, and the
linear-layer routing around it: 2..``GEMV_ROWS_MAX`` rows of a 16-bit layer, under LoRA
too; never in batch-invariant mode (whose tiles are wider); float32 layers stay on
``F.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, ON_GPU, rel_error, tolerance

import pagedlm_cuda.kernels.gemv_rows as gemv_rows_module
from pagedlm import batch_invariant
from pagedlm.lora.layers import LoRALinear
from pagedlm.lora.ops import LoRAStepState, SliceSpec, reference_delta
from pagedlm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedlm_cuda import fused_layers
from pagedlm_cuda.fused_layers import SingleRowLinear, install_fused_kernels
from pagedlm_cuda.kernels.gemv_rows import MAX_ROWS, GemvRowsConfig, gemv_rows

# Triton 3.6's interpreter multiplies bf16 operands of tl.dot as raw bits, so interpreted
# cases use float16 instead; on the GPU they run in bf16 as written.
HALF = torch.bfloat16 if ON_GPU else torch.float16

# 40 and 8200 output rows end inside a 16-row tile; 600 and 1100 features end inside a
# slice (so do 48 and 70 with 32-feature slices); 64 features are one slice.
SHAPES = [(40, 600), (96, 1100), (8200, 64)]
SMALL = GemvRowsConfig(16, 32, 4, 2)


def _reference(x, weight, bias):
    ref = x.double() @ weight.double().T
    return ref + bias.double() if bias is not None else ref


def _operands(rows: int, n: int, k: int, dtype: torch.dtype, with_bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("rows", range(2, MAX_ROWS + 1))
@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_every_row_count_matches_float64(rows: int, dtype: torch.dtype) -> None:
    x, weight, bias = _operands(rows, 48, 70, dtype, True, rows)
    out = gemv_rows(x, weight, bias, config=SMALL)
    assert out.shape == (rows, 48) and out.dtype == dtype
    assert rel_error(out, _reference(x, weight, bias)) < tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_default_tiles_match_float64(dtype, shape: tuple[int, int], with_bias: bool) -> None:
    n, k = shape
    x, weight, bias = _operands(5, n, k, dtype, with_bias, n + k)
    out = gemv_rows(x, weight, bias)
    assert rel_error(out, _reference(x, weight, bias)) < tolerance(dtype)


@pytest.mark.parametrize("config", [SMALL, GemvRowsConfig(32, 64, 4, 3)])
def test_a_row_does_not_depend_on_the_other_rows(config: GemvRowsConfig) -> None:
    """Each row's bits are the same alone with one other row, among 16, after other
    values in the other rows, and call after call."""
    x, weight, bias = _operands(MAX_ROWS, 72, 100, HALF, True, 3)
    full = gemv_rows(x, weight, bias, config=config)
    assert torch.equal(gemv_rows(x, weight, bias, config=config), full)
    assert torch.equal(gemv_rows(x[:2], weight, bias, config=config), full[:2])
    other = x.clone()
    other[1:] = torch.randn_like(other[1:].float()).to(HALF)
    assert torch.equal(gemv_rows(other[:5], weight, bias, config=config)[0], full[0])


def test_reads_a_strided_weight_view_and_row_view() -> None:
    """Rows of a wider matrix (a shard of a fused weight) and rows of a wider
    activation work without a copy."""
    x, full, _ = _operands(4, 24, 200, torch.float32, False, 5)
    weight = full[:, :130]
    rows = x[:, :130]
    out = gemv_rows(rows, weight, config=SMALL)
    assert rel_error(out, rows.double() @ weight.double().T) < tolerance(torch.float32)


def test_rejects_what_it_cannot_compute() -> None:
    weight = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"1 to 16 rows"):
        gemv_rows(torch.randn(MAX_ROWS + 1, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"features"):
        gemv_rows(torch.randn(2, 12, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"cast"):
        gemv_rows(torch.randn(2, 16, device=DEVICE).half(), weight)


def test_the_row_limit_is_off_by_default_and_validated(monkeypatch) -> None:
    monkeypatch.delenv(fused_layers.GEMV_ROWS_MAX_ENV, raising=False)
    assert fused_layers._gemv_rows_max() == 1
    monkeypatch.setenv(fused_layers.GEMV_ROWS_MAX_ENV, "8")
    assert fused_layers._gemv_rows_max() == 8
    for wrong in ("17", "0", "eight"):
        monkeypatch.setenv(fused_layers.GEMV_ROWS_MAX_ENV, wrong)
        with pytest.raises(ValueError, match="from 1"):
            fused_layers._gemv_rows_max()


@pytest.fixture
def rows_calls(monkeypatch):
    """Row counts the few-row kernel was called with (routing on up to 8 rows)."""
    calls: list[int] = []
    kernel = gemv_rows_module.gemv_rows

    def counting(x, *args, **kwargs):
        calls.append(x.shape[0])
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(gemv_rows_module, "gemv_rows", counting)
    monkeypatch.setattr(fused_layers, "GEMV_ROWS_MAX", 8)
    return calls


def _half_layer(in_features: int, out_features: int, seed: int) -> RowParallelLinear:
    torch.manual_seed(seed)
    layer = RowParallelLinear(in_features, out_features, bias=True).to(DEVICE)
    with torch.no_grad():
        layer.weight.normal_(std=in_features**-0.5)
        layer.bias.normal_()
    return layer.to(HALF)


def test_linear_layers_route_by_row_count(rows_calls: list[int]) -> None:
    layer = _half_layer(48, 40, 1)
    install_fused_kernels(torch.nn.Sequential(layer))
    assert isinstance(layer.kernel, SingleRowLinear)
    for rows in (1, 2, 5, 8, 9, 20):
        x = torch.randn(rows, 48, device=DEVICE).to(HALF)
        out = layer.apply_linear(x)
        assert rel_error(out, _reference(x, layer.weight, layer.bias)) < tolerance(HALF)
        if 2 <= rows <= 8:
            assert torch.equal(out, gemv_rows(x, layer.weight, layer.bias))
    assert rows_calls == [2, 5, 8]


def test_float32_layers_and_rows_off_stay_on_f_linear(rows_calls, monkeypatch) -> None:
    layer = RowParallelLinear(32, 24, bias=False).to(DEVICE)
    with torch.no_grad():
        layer.weight.normal_()  # not left uninitialized: NaN bits would never compare equal
    install_fused_kernels(torch.nn.Sequential(layer))
    x = torch.randn(4, 32, device=DEVICE)
    assert torch.equal(layer.apply_linear(x), F.linear(x, layer.weight))
    half = _half_layer(32, 24, 2)
    install_fused_kernels(torch.nn.Sequential(half))
    monkeypatch.setattr(fused_layers, "GEMV_ROWS_MAX", 1)
    x = x.to(HALF)
    assert torch.equal(half.apply_linear(x), F.linear(x, half.weight, half.bias))
    assert rows_calls == []


def test_batch_invariant_mode_never_reaches_the_few_row_kernel(rows_calls) -> None:
    """The mode hands the kernel whole 64-row tiles, beyond ``GEMV_ROWS_MAX``: a row
    gives the same bits alone and in a batch."""
    assert batch_invariant.ROW_TILE > fused_layers.GEMV_ROWS_MAX
    layer = _half_layer(48, 40, 3)
    model = torch.nn.Sequential(layer)
    install_fused_kernels(model)
    batch_invariant.make_batch_invariant(model, tile=16)
    x = torch.randn(5, 48, device=DEVICE).to(HALF)
    batched = layer.apply_linear(x)
    assert torch.equal(layer.apply_linear(x[2:3]), batched[2:3])
    assert rows_calls == []


def test_lora_adds_its_delta_to_the_few_row_kernel(rows_calls) -> None:
    """Several rows with LoRA: the base through the few-row kernel, then the adapters'
    delta added in place (rows without an adapter keep the base's bits)."""
    from pagedlm_cuda.kernels.lora import TritonLoRAOps

    torch.manual_seed(4)
    layer = ColumnParallelLinear(64, 48, bias=False).to(DEVICE)
    with torch.no_grad():
        layer.weight.normal_(std=0.125)
    layer = layer.to(HALF)
    install_fused_kernels(torch.nn.Sequential(layer))
    slots = torch.tensor([0, -1, 1, 0], dtype=torch.int32)
    groups = [(s, torch.nonzero(slots == s).flatten().to(DEVICE)) for s in (0, 1)]
    state = LoRAStepState(slots.to(DEVICE), groups)
    lora = LoRALinear(layer, 2, 8, state, TritonLoRAOps(), HALF, DEVICE)
    for slot in (0, 1):
        lora.write(slot, 0, torch.randn(8, 64) * 0.1, torch.randn(48, 8) * 0.1)
    layer.set_kernel(lora)
    x = torch.randn(4, 64, device=DEVICE).to(HALF)
    out = layer.apply_linear(x)
    expected = _reference(x, layer.weight, None).cpu()
    expected += reference_delta(x, lora.lora_a, lora.lora_b, (SliceSpec(0, 48),), slots)
    assert rel_error(out, expected) < tolerance(HALF)
    assert torch.equal(out[1], gemv_rows(x, layer.weight)[1])
    assert rows_calls == [4]


@pytest.mark.cuda
def test_a_cuda_graph_replays_the_eager_bits() -> None:
    """Captured once over fixed buffers, replayed with other rows (PDL launches
    included): every replay gives the eager call's bits."""
    x, weight, bias = _operands(5, 4096, 4096, torch.bfloat16, True, 6)
    static = x.clone()
    gemv_rows(static, weight, bias)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv_rows(static, weight, bias)
    for seed in (7, 8):
        fresh, _, _ = _operands(5, 4096, 4096, torch.bfloat16, False, seed)
        static.copy_(fresh)
        graph.replay()
        assert torch.equal(out, gemv_rows(fresh, weight, bias))
