"""The single-row GEMV kernel against a float64 reference, and the linear-layer hook that
routes one-row inputs to it (everything else stays on ``F.linear``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, rel_error, tolerance

from pagedlm.model_executor.layers.linear import RowParallelLinear
from pagedlm_cuda.fused_layers import SingleRowLinear, install_fused_kernels
from pagedlm_cuda.kernels.gemv import GemvConfig, gemv, gemv_config

# Rows not a multiple of the 16-row tile; columns not a multiple of the slice; and each
# of the three tile configurations (up to 4k, 8k and beyond 8k outputs). Every dtype with
# and without a bias on the first; the two larger tiles (hundreds of programs each under
# the interpreter) once in each dtype, half of them with a bias.
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 64), (40, 600), (96, 1100)]
GEMV_CASES = [
    *((dtype, shape, with_bias) for with_bias in (False, True) for shape in SHAPES
      for dtype in DTYPES),
    *((dtype, shape, index % 2 == 1) for shape in [(5000, 64), (8200, 64)]
      for index, dtype in enumerate(DTYPES)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "shape", "with_bias"),
    GEMV_CASES,
    ids=[f"{str(d)[6:]}-{n}x{k}{'-bias' * b}" for d, (n, k), b in GEMV_CASES],
)
def test_gemv_matches_float64(dtype: torch.dtype, shape: tuple[int, int], with_bias: bool):
    n, k = shape
    torch.manual_seed(n * 7 + k)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype) if with_bias else None
    out = gemv(x, weight, bias)
    ref = x.double() @ weight.double().T
    if bias is not None:
        ref += bias.double()
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_error(out, ref) < tolerance(dtype)


# Tiles other than the defaults, at slices small enough for several per row: the
# pipelined loop (more stages than slices, too) and narrow row blocks.
TILES = [
    GemvConfig(16, 64, 4, 3),
    GemvConfig(8, 128, 4, 2),
    GemvConfig(16, 128, 4, 4),
    GemvConfig(8, 512, 4, 4),
]


def test_gemv_refuses_split_k() -> None:
    x = torch.randn(1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="split_k must be 1"):
        gemv(x, torch.randn(16, 64, device=DEVICE), config=GemvConfig(16, 64, 4, 1, 2))


@pytest.mark.parametrize("config", TILES, ids=str)
@pytest.mark.parametrize("shape", [(40, 1100), (33, 600)])
def test_gemv_tiles_match_float64(config: GemvConfig, shape: tuple[int, int]) -> None:
    n, k = shape
    torch.manual_seed(n + k)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(torch.bfloat16)
    bias = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    out = gemv(x, weight, bias, config=config)
    ref = x.double() @ weight.double().T + bias.double()
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    assert rel_error(out, ref) < tolerance(torch.bfloat16)


def test_each_weight_kind_has_its_own_default_tiles() -> None:
    """FP8 codes and GGUF blocks pipeline their loop (measured faster); bf16, the
    float16-product GGUF GEMV and 8-bit codes at q/k/v's shape do not."""
    for n in (4096, 6144, 28672):
        assert gemv_config(n, 4096).pipeline_stages == 1
        assert gemv_config(n, 4096, "gguf4h").pipeline_stages == 1
        assert gemv_config(n, 4096, "gguf8").pipeline_stages == (1 if n == 6144 else 3)
        for kind in ("fp8", "gguf4"):
            assert gemv_config(n, 4096, kind).pipeline_stages == 3


def test_pipelined_gemv_applies_fp8_scales_and_bias() -> None:
    from pagedlm.model_executor.quantization import fp8

    torch.manual_seed(4)
    codes, scales = fp8.quantize_rows(torch.randn(40, 600, device=DEVICE) / 600**0.5)
    x = torch.randn(1, 600, device=DEVICE)
    bias = torch.randn(40, device=DEVICE)
    out = gemv(x, codes, bias, scales, config=GemvConfig(16, 128, 4, 3))
    ref = x.double() @ fp8.dequantize(codes, scales).double().T + bias.double()
    assert rel_error(out, ref) < 1e-5


def test_gemv_reads_a_strided_weight_view() -> None:
    """Rows of a wider matrix (a shard of a fused weight) work without a copy."""
    torch.manual_seed(0)
    full = torch.randn(24, 200, device=DEVICE)
    weight = full[:, :130]
    x = torch.randn(1, 130, device=DEVICE)
    assert rel_error(gemv(x, weight), x.double() @ weight.double().T) < tolerance(torch.float32)


def test_gemv_rejects_what_it_cannot_compute() -> None:
    weight = torch.randn(8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"one row"):
        gemv(torch.randn(2, 16, device=DEVICE), weight)
    with pytest.raises(ValueError, match=r"features"):
        gemv(torch.randn(1, 12, device=DEVICE), weight)


def test_linear_layers_route_one_row_to_the_gemv() -> None:
    torch.manual_seed(1)
    layer = RowParallelLinear(48, 40, bias=True).to(DEVICE)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    model = torch.nn.Sequential(layer)
    install_fused_kernels(model)
    assert isinstance(layer.kernel, SingleRowLinear)
    for rows in (1, 3):
        x = torch.randn(rows, 48, device=DEVICE)
        expected = F.linear(x, layer.weight, layer.bias)
        assert rel_error(layer.apply_linear(x), expected) < tolerance(torch.float32)


def test_layers_with_their_own_kernel_keep_it() -> None:
    layer = RowParallelLinear(16, 8, bias=False)
    own = object()
    layer.set_kernel(own)
    install_fused_kernels(torch.nn.Sequential(layer))
    assert layer.kernel is own


def test_configs_from_the_environment_replace_the_defaults(tmp_path, monkeypatch) -> None:
    """``PAGEDLM_GEMV_CONFIGS`` (for measuring): its shapes take its tiles, others keep
    the defaults, and a malformed entry names the expected form."""
    from pagedlm_cuda.kernels import gemv as module

    table = tmp_path / "tiles.json"
    table.write_text('{"40,1100": [16, 128, 4, 2], "40,1100,fp8": [8, 256, 4, 3]}')
    monkeypatch.setenv(module.CONFIGS_ENV, str(table))
    module._configs_from_env.cache_clear()
    try:
        assert module.gemv_config(40, 1100) == GemvConfig(16, 128, 4, 2)
        assert module.gemv_config(40, 1100, "fp8") == GemvConfig(8, 256, 4, 3)
        assert module.gemv_config(40, 1100, "gguf4") == GemvConfig(16, 512, 2, 3, 4)
        assert module.gemv_config(6144, 1100, "gguf4") == GemvConfig(8, 1024, 1, 3, 2)
        assert module.gemv_config(40, 1100, "gguf8") == GemvConfig(8, 512, 1, 3, 4)
        assert module.gemv_config(28672, 1100, "gguf8") == GemvConfig(8, 512, 1, 3)
        table.write_text('{"40,1100,gguf4": [8, 512, 1, 3, 4]}')  # split_k: a fifth
        module._configs_from_env.cache_clear()
        assert module.gemv_config(40, 1100, "gguf4") == GemvConfig(8, 512, 1, 3, 4)
        assert module.gemv_config(40, 600) == GemvConfig(16, 1024, 8)
        table.write_text('{"40,1100": [16, 0, 4]}')
        module._configs_from_env.cache_clear()
        with pytest.raises(ValueError, match=r"block_n, block_k, num_warps"):
            module.gemv_config(40, 1100)
        table.write_text('{"40,1100,int3": [16, 128, 4]}')
        module._configs_from_env.cache_clear()
        with pytest.raises(ValueError, match=r"KIND one of bf16, fp8, gguf4, gguf8"):
            module.gemv_config(40, 1100)
    finally:
        monkeypatch.delenv(module.CONFIGS_ENV)
        module._configs_from_env.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 80, 1030])
@pytest.mark.parametrize("config", [None, GemvConfig(8, 128, 4, 2)], ids=["default", "tile"])
def test_gemv_silu_and_mul_matches_the_two_kernels(dtype, n: int, config) -> None:
    """``silu_and_mul=True``: the activation in the GEMV's epilogue, exactly what the plain
    GEMV followed by the activation kernel gives (row counts past a tile's half too)."""
    from pagedlm_cuda.kernels import silu_and_mul

    torch.manual_seed(n)
    k = 300
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    fused = gemv(x, weight, bias, config=config, silu_and_mul=True)
    assert fused.shape == (1, n // 2) and fused.dtype == dtype
    assert torch.equal(fused, silu_and_mul(gemv(x, weight, bias, config=config)))
    with pytest.raises(ValueError, match="even row count"):
        gemv(x, weight[:-1], None, config=config, silu_and_mul=True)


def test_swiglu_mlp_runs_one_row_through_the_fused_epilogue(monkeypatch) -> None:
    """A Llama MLP on the platform's kernels: one row takes the fused GEMV and 3 rows the
    fused few-row GEMM (the activation kernel is not called), 33 rows the two kernels, all
    as the unfused layers compute; a linear kernel without the epilogue (a LoRA wrapper,
    say) keeps the two steps."""
    import pagedlm_cuda.fused_layers as fused_layers
    from pagedlm.config import ArchConfig
    from pagedlm.model_executor.models.llama import LlamaMLP

    arch = ArchConfig.from_hf_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "hidden_act": "silu", "vocab_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 4}
    )  # fmt: skip
    torch.manual_seed(0)
    mlp = LlamaMLP(arch, bias=False)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.weight.data.normal_(0, 0.1)
    mlp = mlp.to(DEVICE, torch.bfloat16)
    x = torch.randn(33, 64, device=DEVICE).to(torch.bfloat16)
    expected = [mlp(x[:1]), mlp(x[:3]), mlp(x)]  # torch code
    install_fused_kernels(mlp)
    calls = []
    kernel = mlp.act_fn.kernel
    mlp.act_fn.set_kernel(lambda h: calls.append(h.shape[0]) or kernel(h))
    got = [mlp(x[:1]), mlp(x[:3]), mlp(x)]
    assert calls == [33]
    for a, b in zip(got, expected):
        assert rel_error(a, b) < tolerance(torch.bfloat16)
    monkeypatch.setattr(fused_layers.SingleRowLinear, "silu_and_mul", None)
    assert torch.equal(mlp(x[:1]), got[0]) and calls == [33, 1]
    assert torch.equal(mlp(x[:3]), got[1]) and calls == [33, 1, 3]
