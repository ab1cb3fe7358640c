"""RowSplitLinear: the int4 kernel for small batches, a dense copy from the threshold on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu.test_quantized_linear import Tiny, random_blocks
from pagedlm.batch_invariant import make_batch_invariant
from pagedlm.model_executor.layers.linear import ColumnParallelLinear
from pagedlm_cpu import platform as cpu_platform
from pagedlm_cpu.linear import onednn_available
from pagedlm_cpu.quantized_linear import (
    DequantScratch,
    Int4Linear,
    install_int4_kernels,
    int4_kernel_available,
)
from pagedlm_cpu.row_split_linear import (
    DEFAULT_DENSE_FROM_ROWS,
    RowSplitLinear,
    dense_copy_bytes,
    install_dense_copies,
)

pytestmark = pytest.mark.skipif(
    not (int4_kernel_available() and onednn_available()), reason="no CPU int4 kernel or oneDNN"
)


def _layer(bits: int, dense_from_rows: int, bias: torch.Tensor | None = None) -> RowSplitLinear:
    from pagedlm_cpu.linear import OneDnnLinear

    blocks = random_blocks(48, 64, bits, seed=bits)
    quantized = Int4Linear(blocks, bias, DequantScratch())
    return RowSplitLinear(quantized, OneDnnLinear(blocks.dequantize(), bias), dense_from_rows)


@pytest.mark.parametrize(("bits", "first_dense_row"), [(4, 8), (8, 4)])
def test_the_row_count_picks_the_kernel(bits, first_dense_row):
    bias = torch.randn(48)
    layer = _layer(bits, dense_from_rows=8, bias=bias)
    # Two 4-bit planes (Q8_0 codes) double the int4 kernel's work: the copy takes over at
    # half the rows.
    assert layer.dense_from_rows == first_dense_row
    weight = layer.quantized.blocks.dequantize()
    small = torch.randn(first_dense_row - 1, 64)
    assert torch.equal(layer(small), layer.quantized(small))  # the int4 kernel itself
    large = torch.randn(first_dense_row, 64)
    # float32 weights: F.linear's result up to summation order, no bf16 rounding.
    torch.testing.assert_close(layer(large), F.linear(large, weight, bias), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(layer.quantized(large), F.linear(large, weight, bias), atol=1e-5)


def test_bf16_activations_come_back_bf16_from_the_float32_copy():
    layer = _layer(4, dense_from_rows=2)
    x = torch.randn(5, 64).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    expected = F.linear(x.float(), layer.quantized.blocks.dequantize()).to(torch.bfloat16)
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)


def test_a_bf16_copy_computes_in_bf16_whatever_the_activations():
    from pagedlm_cpu.linear import OneDnnLinear

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 on this CPU")
    blocks = random_blocks(48, 64, 4, seed=3)
    bias = torch.randn(48)
    weight = blocks.dequantize().to(torch.bfloat16)
    dense = OneDnnLinear(weight, bias.to(torch.bfloat16))
    layer = RowSplitLinear(Int4Linear(blocks, bias, DequantScratch()), dense, 4, torch.bfloat16)
    x = torch.randn(6, 64)
    expected = F.linear(x.to(torch.bfloat16), weight, bias.to(torch.bfloat16))
    out = layer(x)
    assert out.dtype == torch.float32  # back in the activations' dtype
    torch.testing.assert_close(out, expected.float(), rtol=2e-2, atol=2e-2)
    assert torch.equal(layer(x.to(torch.bfloat16)), dense(x.to(torch.bfloat16)))


def _tiny_quantized() -> tuple[nn.Module, dict]:
    model = Tiny()
    blocks = {"up": random_blocks(96, 64, 4), "head": random_blocks(64, 64, 8)}
    assert install_int4_kernels(model, blocks) == 2
    return model, blocks


def test_install_wraps_every_int4_layer_within_the_budget():
    model, blocks = _tiny_quantized()
    assert dense_copy_bytes(model) == (96 * 64 + 64 * 64) * 4
    assert dense_copy_bytes(model, torch.bfloat16) == (96 * 64 + 64 * 64) * 2
    assert install_dense_copies(model, 16, budget_bytes=dense_copy_bytes(model)) == 2
    assert isinstance(model.up.kernel, RowSplitLinear)
    assert isinstance(model.head.kernel, RowSplitLinear)
    x = torch.randn(20, 64)
    torch.testing.assert_close(model.up(x), F.linear(x, blocks["up"].dequantize()))
    # The copies serve every row count the int4 layers' own dense path would: their
    # one-byte codes are gone, the packed planes still serve small batches.
    assert model.up.kernel.quantized.blocks is None
    small = torch.randn(3, 64)
    torch.testing.assert_close(
        model.up(small), F.linear(small, blocks["up"].dequantize()), rtol=2e-2, atol=2e-2
    )


def test_batch_invariant_mode_gives_a_row_the_same_bits_at_every_row_count():
    """Outside the mode a row's result depends on the rows sharing its call (bf16 rounding
    in the int4 kernel below the threshold, none in the float32 copy): a request alone, or
    after a prefix-cache hit, can part from its batched run at a near-tie. The mode's
    fixed tiles send every row count to one kernel."""
    model, _ = _tiny_quantized()
    assert install_dense_copies(model, 16, budget_bytes=1 << 40) == 2
    x = torch.randn(20, 64)
    assert not torch.equal(model.up(x[:1]), model.up(x)[:1])
    assert make_batch_invariant(model) == 2
    for layer in (model.up, model.head):
        alone = layer(x[:1])
        assert torch.equal(alone, layer(x[:7])[:1]) and torch.equal(alone, layer(x)[:1])


def test_an_int4_layer_keeps_its_codes_while_its_own_dense_path_is_reachable():
    model, _ = _tiny_quantized()
    model.up.kernel.max_rows = 4  # rows 5..15 would still reach the int4 layer's dense path
    assert install_dense_copies(model, 16, budget_bytes=1 << 40) == 2
    assert model.up.kernel.quantized.blocks is not None
    x = torch.randn(10, 64)
    assert torch.equal(model.up(x), model.up.kernel.quantized(x))


def test_a_released_int4_layer_refuses_rows_past_its_limit():
    layer = Int4Linear(random_blocks(32, 64, 4), None, DequantScratch(), max_rows=4)
    layer.release_codes()
    layer(torch.randn(4, 64))
    with pytest.raises(RuntimeError, match="at most 4 rows"):
        layer(torch.randn(5, 64))


def test_no_copies_over_the_budget_or_when_turned_off():
    model, _ = _tiny_quantized()
    assert install_dense_copies(model, 16, budget_bytes=dense_copy_bytes(model) - 1) == 0
    assert install_dense_copies(model, 0, budget_bytes=1 << 40) == 0
    assert isinstance(model.up.kernel, Int4Linear) and isinstance(model.head.kernel, Int4Linear)
    plain = ColumnParallelLinear(64, 32)  # no int4 kernel: nothing to copy
    assert install_dense_copies(plain, 16, budget_bytes=1 << 40) == 0 and plain.kernel is None


def test_the_platform_reads_the_threshold_from_the_environment(monkeypatch):
    model, _ = _tiny_quantized()
    monkeypatch.setenv(cpu_platform.DENSE_FROM_ROWS_ENV, "0")
    assert "no dense copies" in cpu_platform.CpuPlatform()._install_dense_copies(model)
    monkeypatch.setenv(cpu_platform.DENSE_FROM_ROWS_ENV, "twelve")
    with pytest.raises(ValueError, match="whole number of rows"):
        cpu_platform.CpuPlatform()._install_dense_copies(model)
    monkeypatch.setenv(cpu_platform.DENSE_FROM_ROWS_ENV, "12")
    said = cpu_platform.CpuPlatform()._install_dense_copies(model)
    assert "from 12 rows a float32 copy" in said
    assert model.up.kernel.dense_from_rows == 12 and model.head.kernel.dense_from_rows == 6


@pytest.mark.parametrize(
    ("model_dtype", "fast_bf16", "expected"),
    [
        (torch.bfloat16, True, torch.bfloat16),
        (torch.bfloat16, False, torch.float32),
        (torch.float32, True, torch.float32),
    ],
)
def test_the_copies_are_bf16_only_for_a_bf16_model_with_fast_bf16_gemms(
    monkeypatch, model_dtype, fast_bf16, expected
):
    from types import SimpleNamespace

    if expected == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bf16 on this CPU (fast bf16 is simulated here)")
    monkeypatch.setattr(cpu_platform, "has_fast_bf16_gemms", lambda: fast_bf16)
    platform = cpu_platform.CpuPlatform()
    platform._model_config = SimpleNamespace(dtype=model_dtype)
    assert platform._dense_copy_dtype() == expected
    model, _ = _tiny_quantized()
    monkeypatch.delenv(cpu_platform.DENSE_FROM_ROWS_ENV, raising=False)
    said = platform._install_dense_copies(model)
    kind = str(expected).removeprefix("torch.")
    assert f"a {kind} copy" in said
    assert model.up.kernel.dense_dtype == expected
    assert model.up.kernel.dense_from_rows == DEFAULT_DENSE_FROM_ROWS[expected]


def test_native_bf16_off_means_no_amx(monkeypatch):
    monkeypatch.setenv(cpu_platform.NATIVE_BF16_ENV, "0")
    assert not cpu_platform.has_amx()
    assert not cpu_platform.has_fast_bf16_gemms()


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "vendor", "expected"),
    [
        (True, True, "GenuineIntel", True),
        (False, True, "GenuineIntel", False),  # session 9's Xeon: bf16 slower from 16 rows
        (False, True, "AuthenticAMD", True),  # Zen 4 (session 30)
        (False, False, "AuthenticAMD", False),
    ],
)
def test_fast_bf16_gemms_are_amx_or_amd_with_avx512_bf16(
    monkeypatch, amx, avx512_bf16, vendor, expected
):
    monkeypatch.delenv(cpu_platform.NATIVE_BF16_ENV, raising=False)
    probes = {"_is_amx_tile_supported": amx, "_is_avx512_bf16_supported": avx512_bf16}
    monkeypatch.setattr(cpu_platform, "_cpu_probe", lambda name: probes[name])
    monkeypatch.setattr(cpu_platform, "cpu_vendor", lambda: vendor)
    assert cpu_platform.has_fast_bf16_gemms() == expected
