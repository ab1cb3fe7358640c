"""Fused RMSNorm(+residual), rotary (neox and gptj) and SiLU-and-mul kernels against
float64 references, and against the torch layers they replace."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, ON_GPU, rel_error

from pagedlm.model_executor.layers.activation import SiluAndMul
from pagedlm.model_executor.layers.layernorm import RMSNorm
from pagedlm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagedlm_cuda.fused_layers import install_fused_kernels
from pagedlm_cuda.kernels import fused_add_rms_norm, rms_norm, rotary_embedding, silu_and_mul

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rms_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96, 1024])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(hidden)
    x = torch.randn(7, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(7, hidden, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=DEVICE)).to(dtype)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    assert rel_error(out, rms_reference(x.cpu(), weight.cpu(), 1e-6)) < TOL[dtype]

    out, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_sum = x + residual
    if ON_GPU or dtype != torch.bfloat16:
        assert torch.equal(summed, expected_sum)
    else:  # the interpreter rounds float32 -> bf16 by truncation, not to nearest
        assert rel_error(summed, expected_sum) < TOL[dtype]
    assert rel_error(out, rms_reference(expected_sum.cpu(), weight.cpu(), 1e-6)) < TOL[dtype]


def rope_reference(x, positions, cos_sin, head_dim, neox):
    """x [T, H * D] -> rotated in float64."""
    half = head_dim // 2
    x64 = x.double().cpu().view(x.shape[0], -1, head_dim)
    cs = cos_sin.double().cpu()[positions.cpu()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    if neox:
        a, b = x64[..., :half], x64[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    else:
        a, b = x64[..., 0::2], x64[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    return out.reshape(x.shape[0], -1)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_strided_views(neox: bool, dtype: torch.dtype, head_dim: int) -> None:
    torch.manual_seed(head_dim)
    num_heads, num_kv_heads, tokens = 4, 2, 5
    rope = RotaryEmbedding(head_dim, 256, 10000.0).to(DEVICE)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    positions = torch.tensor([0, 3, 255, 17, 100], device=DEVICE)
    q_ref = rope_reference(q, positions, rope.cos_sin_cache, head_dim, neox)
    k_ref = rope_reference(k, positions, rope.cos_sin_cache, head_dim, neox)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    out_q, out_k = rotary_embedding(positions, q, k, rope.cos_sin_cache, head_dim, neox)
    assert out_q.data_ptr() == q.data_ptr()
    assert rel_error(out_q, q_ref) < TOL[dtype]
    assert rel_error(out_k, k_ref) < TOL[dtype]
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_qk_norm_normalizes_each_head_first(neox: bool, dtype: torch.dtype):
    """Qwen3's per-head q/k RMSNorm fused into the rotation, on views of one qkv tensor."""
    torch.manual_seed(7)
    head_dim, num_heads, num_kv_heads, tokens = 64, 4, 2, 5
    rope = RotaryEmbedding(head_dim, 256, 10000.0).to(DEVICE)
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    q_weight = (1 + 0.2 * torch.randn(head_dim, device=DEVICE)).to(dtype)
    k_weight = (1 + 0.2 * torch.randn(head_dim, device=DEVICE)).to(dtype)
    positions = torch.tensor([0, 3, 255, 17, 100], device=DEVICE)

    def normed(x, weight):
        heads = x.double().cpu().view(tokens, -1, head_dim)
        return rms_reference(heads, weight.cpu(), 1e-6).reshape(tokens, -1)

    q_ref = rope_reference(normed(q, q_weight), positions, rope.cos_sin_cache, head_dim, neox)
    k_ref = rope_reference(normed(k, k_weight), positions, rope.cos_sin_cache, head_dim, neox)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    out_q, out_k = rotary_embedding(
        positions, q, k, rope.cos_sin_cache, head_dim, neox, qk_norm=(q_weight, k_weight, 1e-6)
    )
    assert out_q.data_ptr() == q.data_ptr()
    assert rel_error(out_q, q_ref) < TOL[dtype]
    assert rel_error(out_k, k_ref) < TOL[dtype]
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


def test_rotary_layer_fuses_plain_qk_norms_only() -> None:
    """With q/k norms the layer gives the torch result whether the kernel fuses them (plain
    RMSNorm) or they run first on their own (any other norm)."""

    class OffsetNorm(RMSNorm):  # a norm the kernel must not fold in
        def forward(self, x, residual=None):
            return super().forward(x, residual) * 2

    torch.manual_seed(3)
    head_dim = 32
    positions = torch.tensor([1, 2, 3, 60, 0], device=DEVICE)
    q, k = torch.randn(5, 4 * head_dim, device=DEVICE), torch.randn(5, 2 * head_dim, device=DEVICE)
    for norm_cls in (RMSNorm, OffsetNorm):
        norms = (norm_cls(head_dim, 1e-6).to(DEVICE), norm_cls(head_dim, 1e-6).to(DEVICE))
        for norm in norms:
            norm.weight.data.normal_()
        rope = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
        expected = rope(positions, q.clone(), k.clone(), qk_norm=norms)
        install_fused_kernels(torch.nn.ModuleList([rope, *norms]))
        fused = rope(positions, q.clone(), k.clone(), qk_norm=norms)
        for a, b in zip(expected, fused):
            assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 1500])
def test_silu_and_mul(dtype: torch.dtype, d: int) -> None:
    torch.manual_seed(d)
    x = torch.randn(6, 2 * d, device=DEVICE).to(dtype)
    x64 = x.double().cpu()
    gate, up = x64[:, :d], x64[:, d:]
    ref = gate / (1 + torch.exp(-gate)) * up
    assert rel_error(silu_and_mul(x), ref) < TOL[dtype]


@pytest.mark.parametrize("neox", [True, False])
def test_install_fused_kernels_matches_torch_layers(neox: bool) -> None:
    """The layers give the same results (to rounding) with and without their kernels."""
    torch.manual_seed(1)
    model = torch.nn.ModuleDict(
        {
            "norm": RMSNorm(64, 1e-5),
            "rope": RotaryEmbedding(32, 64, 10000.0),
            "act": SiluAndMul(),
        }
    ).to(DEVICE)
    model["rope"].is_neox_style = neox
    model["norm"].weight.data.normal_()
    x, res = torch.randn(2, 5, 64, device=DEVICE)
    positions = torch.tensor([1, 2, 3, 60, 0], device=DEVICE)
    eager = (
        model["norm"](x, res),
        model["rope"](positions, x.clone(), res.clone()),
        model["act"](x),
    )
    assert install_fused_kernels(model) == 3
    fused = (
        model["norm"](x, res),
        model["rope"](positions, x.clone(), res.clone()),
        model["act"](x),
    )
    for a, b in zip(eager, fused):
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        for ta, tb in zip(a, b):
            assert torch.allclose(ta, tb, atol=1e-5, rtol=1e-5)


def test_dependent_launch_is_off_where_it_cannot_run(monkeypatch) -> None:
    from pagedlm_cuda.kernels import pdl

    monkeypatch.setenv(pdl.PDL_ENV, "0")
    pdl.enabled.cache_clear()
    try:
        assert not pdl.enabled() and pdl.launch_options() == {"USE_PDL": False}
        monkeypatch.delenv(pdl.PDL_ENV)
        pdl.enabled.cache_clear()
        if not ON_GPU:  # the interpreter has no grid dependency control
            assert not pdl.enabled()
    finally:
        pdl.enabled.cache_clear()


def test_mrope_layer_takes_the_kernel_for_flat_positions_only() -> None:
    """M-RoPE's [T] positions (text tokens) go through the plain rotary kernel; its
    [3, T] positions keep the torch code, kernel or not."""
    from pagedlm.model_executor.layers.rotary_mrope import MRotaryEmbedding

    torch.manual_seed(2)
    rope = MRotaryEmbedding(32, 64, 10000.0, [4, 6, 6]).to(DEVICE)
    q, k = torch.randn(2, 5, 64, device=DEVICE)
    flat = torch.tensor([1, 2, 3, 60, 0], device=DEVICE)
    three = torch.tensor([[1, 2, 2, 5, 0], [1, 3, 4, 6, 0], [1, 2, 7, 5, 0]], device=DEVICE)
    eager = (rope(flat, q.clone(), k.clone()), rope(three, q.clone(), k.clone()))
    assert install_fused_kernels(torch.nn.Sequential(rope)) == 1
    fused = (rope(flat, q.clone(), k.clone()), rope(three, q.clone(), k.clone()))
    for a, b in zip(eager, fused):
        for ta, tb in zip(a, b):
            assert torch.allclose(ta, tb, atol=1e-5, rtol=1e-5)
