"""The CPU norm and rotary kernels against the layers' own torch code."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm_cpu.fused_layers import NeoxRotary, _adjacent_heads, install_fused_kernels

# bf16: a value may round to the neighbouring bf16 number (one unit in the last place,
# 2^-7 relative); float32: summation order only.
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 0, "rtol": 2**-7},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5])
def test_rms_norm_matches_the_torch_code(dtype, rows):
    torch.manual_seed(0)
    norm = RMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(96).to(dtype)
    x, residual = (torch.randn(rows, 96) * 3).to(dtype), torch.randn(rows, 96).to(dtype)
    expected, expected_residual = norm(x, residual)
    expected_alone = norm(x)
    strided = (torch.randn(rows, 200) * 3).to(dtype)[:, 10:106]  # a column slice of a buffer
    expected_strided = norm(strided)
    install_fused_kernels(norm)
    assert norm.kernel is not None
    out, out_residual = norm(x, residual)
    assert out.dtype == dtype and out_residual.dtype == dtype
    torch.testing.assert_close(out_residual, expected_residual, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(norm(x), expected_alone, **TOLERANCE[dtype])
    torch.testing.assert_close(norm(strided), expected_strided, **TOLERANCE[dtype])


def _qkv(tokens: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(tokens, (4 + 2 + 2) * 32).to(dtype)  # 4 q heads, 2 kv heads, d 32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("adjacent", [True, False])
@pytest.mark.parametrize("inference", [False, True])
def test_rotary_matches_the_torch_code(dtype, adjacent, inference):
    """Also under ``torch.inference_mode``, as the engine runs it: its views have no
    ``_base``, and q's and k's heads must still be found adjacent."""
    torch.manual_seed(1)
    rotary = RotaryEmbedding(32, 512, 10000.0)
    with torch.inference_mode(inference):
        _check_rotary(rotary, _qkv(6, dtype), dtype, adjacent)


def test_adjacency_is_judged_by_storage_and_address_not_by_base():
    buffer = torch.randn(6, 256)
    q = buffer[:, :128]
    k = torch.empty(0).set_(buffer.untyped_storage(), 128, (6, 64), (256, 1))
    assert k._base is None and _adjacent_heads(q, k, 32) is not None  # one storage, k after q
    # Two storages over one memory block (two numpy views of one array): k's columns
    # follow q's in memory, but one view over q's storage could not reach them.
    import numpy as np

    array = np.random.rand(6, 256).astype(np.float32)
    q, k = torch.from_numpy(array[:, :128]), torch.from_numpy(array[:, 128:192])
    assert k.data_ptr() == q.data_ptr() + 128 * 4 and q.stride() == k.stride()
    assert _adjacent_heads(q, k, 32) is None


def _check_rotary(rotary: RotaryEmbedding, qkv: torch.Tensor, dtype, adjacent: bool) -> None:
    q, k, _ = qkv.split([128, 64, 64], dim=-1)
    if not adjacent:  # separate tensors: rotated one by one
        q, k = q.clone(), k.clone()
    assert (_adjacent_heads(q, k, 32) is not None) == adjacent
    positions = torch.tensor([0, 3, 100, 101, 7, 511])
    expected_q, expected_k = rotary(positions, q.clone(), k.clone())
    before = qkv.clone()
    install_fused_kernels(rotary)
    out_q, out_k = rotary(positions, q, k)
    assert out_q.shape == q.shape and out_k.shape == k.shape
    # bf16: each product rounds (to half a unit of the inputs' magnitude, up to ~4 here)
    # before the torch code's subtraction, so near-zero results differ absolutely.
    tolerance = TOLERANCE[dtype] if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2**-7}
    torch.testing.assert_close(out_q, expected_q, **tolerance)
    torch.testing.assert_close(out_k, expected_k, **tolerance)
    assert torch.equal(qkv, before)  # new tensors: the projection's output is left alone


def test_rotary_gathers_once_per_positions():
    """Layers of a step share its positions: the second call reuses the gathered rows; the
    next step's positions, or the same tensor written in place, are gathered afresh."""
    rotary = RotaryEmbedding(32, 64, 10000.0)
    kernel = NeoxRotary()
    q, k, _ = _qkv(2, torch.float32).split([128, 64, 64], dim=-1)
    for values in ([3, 9], [4, 10]):
        positions = torch.tensor(values)
        expected = rotary(positions, q.clone(), k.clone())
        cos_sin_cache = rotary.cos_sin_cache
        first = kernel(positions, q, k, cos_sin_cache, 32, True)
        rows = kernel._last
        second = kernel(positions, q, k, cos_sin_cache, 32, True)
        assert kernel._last is rows
        for got in (first, second):
            torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    # The same tensor written in place (a persistent buffer's next step) is gathered anew.
    positions[:] = torch.tensor([7, 1])
    expected = rotary(positions, q.clone(), k.clone())
    got = kernel(positions, q, k, rotary.cos_sin_cache, 32, True)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_rotary_sees_writes_its_version_counter_misses():
    """A persistent positions buffer written through a numpy view (torch's version counter
    does not move), or made under ``torch.inference_mode`` (it has none), and passed again
    as the same tensor, as a replayed graph passes it: the rows follow its values.
    (Rows keyed on the tensor and its version gave a graph's next decode step the
    previous step's rotation.)"""
    rotary = RotaryEmbedding(32, 64, 10000.0)
    q, k, _ = _qkv(2, torch.float32).split([128, 64, 64], dim=-1)
    kernel = NeoxRotary()
    positions = torch.tensor([3, 9])
    kernel(positions, q, k, rotary.cos_sin_cache, 32, True)
    version = positions._version
    positions.numpy()[:] = [7, 1]
    assert positions._version == version
    expected = rotary(positions, q.clone(), k.clone())
    got = kernel(positions, q, k, rotary.cos_sin_cache, 32, True)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])
    kernel = NeoxRotary()
    with torch.inference_mode():
        positions = torch.tensor([3, 9])
        kernel(positions, q, k, rotary.cos_sin_cache, 32, True)
        positions[:] = torch.tensor([7, 1])
        expected = rotary(positions, q.clone(), k.clone())
        got = kernel(positions, q, k, rotary.cos_sin_cache, 32, True)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_rotary_with_per_head_norms_matches_the_unfused_layers():
    torch.manual_seed(2)
    rotary = RotaryEmbedding(32, 64, 10000.0)
    q_norm, k_norm = RMSNorm(32, 1e-6), RMSNorm(32, 1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.rand(32) + 0.5, torch.rand(32) + 0.5
    q, k, _ = _qkv(3, torch.float32).split([128, 64, 64], dim=-1)
    positions = torch.tensor([1, 2, 63])
    expected = rotary(positions, q, k, (q_norm, k_norm))
    rotary.set_kernel(NeoxRotary())
    for got, want in zip(rotary(positions, q, k, (q_norm, k_norm)), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


class _OtherNorm(RMSNorm):
    pass


def test_install_skips_subclasses_and_gptj_pairs():
    model = nn.ModuleList([RMSNorm(8), _OtherNorm(8), RotaryEmbedding(16, 8, 10000.0)])
    gptj = RotaryEmbedding(16, 8, 10000.0)
    gptj.is_neox_style = False
    model.append(gptj)
    assert install_fused_kernels(model) == 2
    assert model[0].kernel is not None and model[2].kernel is not None
    assert model[1].kernel is None and gptj.kernel is None
    assert install_fused_kernels(model) == 0  # layers with a kernel keep it
