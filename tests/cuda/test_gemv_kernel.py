"""The single-row GEMV kernel against a float64 reference, and the linear-layer hook that
routes one-row inputs to it (everything else stays on ``F.linear``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_env import DEVICE, ON_GPU, rel_error, tolerance

from pagedlm.model_executor.layers.linear import RowParallelLinear
from pagedlm_cuda.fused_layers import SingleRowLinear, install_fused_kernels
from pagedlm_cuda.kernels.gemv import GemvConfig, gemv, gemv_config

# Rows not a multiple of the 16-row tile; columns not a multiple of the slice; and each
# of the three tile configurations (up to 4k, 8k and beyond 8k outputs).
SHAPES = [(1, 64), (40, 600), (96, 1100), (5000, 64), (8200, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
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
    """FP8 codes and GGUF blocks pipeline their loop (measured faster); bf16 does not."""
    for n in (4096, 6144, 28672):
        assert gemv_config(n, 4096).pipeline_stages == 1
        for kind in ("fp8", "gguf4", "gguf8"):
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
        assert module.gemv_config(40, 1100, "gguf4") == GemvConfig(8, 512, 1, 3)
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
    """A Llama MLP on the platform's kernels: one row takes the fused GEMV (the activation
    kernel is not called), more rows the two kernels, both as the unfused layers compute;
    a linear kernel without the epilogue (a LoRA wrapper, say) keeps the two steps."""
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
    x = torch.randn(3, 64, device=DEVICE).to(torch.bfloat16)
    expected = [mlp(x[:1]), mlp(x)]  # torch code
    install_fused_kernels(mlp)
    calls = []
    kernel = mlp.act_fn.kernel
    mlp.act_fn.set_kernel(lambda h: calls.append(h.shape[0]) or kernel(h))
    got = [mlp(x[:1]), mlp(x)]
    assert calls == [3]
    for a, b in zip(got, expected):
        assert rel_error(a, b) < tolerance(torch.bfloat16)
    monkeypatch.setattr(fused_layers.SingleRowLinear, "silu_and_mul", None)
    assert torch.equal(mlp(x[:1]), got[0]) and calls == [3, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [2, 80, 1030])
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
@pytest.mark.parametrize("config", [None, GemvConfig(8, 128, 4, 2)], ids=["default", "tile"])
def test_gemv_add_rms_norm_matches_the_two_kernels(dtype, n: int, silu: bool, config) -> None:
    """``gemv_add_rms_norm``: the block's add and RMSNorm in the GEMV's prologue give the
    residual bit for bit and the projection of the normalized row as the norm kernel and
    the GEMV give it (bit for bit in the interpreter; on a GPU the mean square's reduction
    follows the GEMV's warps, so the last bit of a normalized element may differ)."""
    from pagedlm_cuda.kernels import fused_add_rms_norm
    from pagedlm_cuda.kernels.gemv import gemv_add_rms_norm

    torch.manual_seed(n)
    k = 300
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    residual = torch.randn(1, k, device=DEVICE).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, device=DEVICE)).to(dtype)
    weight = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    normed, expected_residual = fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    expected = gemv(normed, weight, bias, config=config, silu_and_mul=silu)
    out, new_residual = gemv_add_rms_norm(
        x, residual, norm_weight, 1e-6, weight, bias, config=config, silu_and_mul=silu
    )
    assert torch.equal(new_residual, expected_residual)
    assert out.shape == expected.shape and out.dtype == dtype
    if ON_GPU:
        assert rel_error(out, expected) < tolerance(dtype) / 10
    else:
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="norm weight"):
        gemv_add_rms_norm(x, residual, norm_weight.double(), 1e-6, weight)


def test_gemv_add_rms_norm_applies_fp8_scales() -> None:
    """The norm prologue over FP8 codes with a scale per row (``Fp8CudaLinear``'s GEMV)."""
    from pagedlm.model_executor.quantization import fp8
    from pagedlm_cuda.kernels import fused_add_rms_norm
    from pagedlm_cuda.kernels.gemv import gemv_add_rms_norm

    torch.manual_seed(3)
    codes, scales = fp8.quantize_rows(torch.randn(40, 600, device=DEVICE) / 600**0.5)
    x, residual = torch.randn(2, 1, 600, device=DEVICE).to(torch.bfloat16)
    norm_weight = torch.rand(600, device=DEVICE).to(torch.bfloat16)
    normed, _ = fused_add_rms_norm(x, residual, norm_weight, 1e-5)
    out, _ = gemv_add_rms_norm(x, residual, norm_weight, 1e-5, codes, None, scales)
    ref = normed.double() @ fp8.dequantize(codes, scales).double().T
    assert rel_error(out, ref) < tolerance(torch.bfloat16)


def test_pending_norm_fuses_into_one_row_projections(monkeypatch) -> None:
    """A Llama MLP handed a ``PendingNorm``: one row runs norm, gate/up and activation in
    one GEMV (neither the norm's nor the activation's kernel is called), more rows the
    separate kernels, and both agree with the torch code; the next residual is the sum."""
    import pagedlm_cuda.fused_layers as fused_layers
    from pagedlm.config import ArchConfig
    from pagedlm.model_executor.layers.layernorm import PendingNorm, RMSNorm
    from pagedlm.model_executor.models.llama import LlamaMLP

    arch = ArchConfig.from_hf_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "hidden_act": "silu", "vocab_size": 8, "num_hidden_layers": 1,
         "num_attention_heads": 4}
    )  # fmt: skip
    torch.manual_seed(1)
    mlp = LlamaMLP(arch, bias=False)
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        linear.weight.data.normal_(0, 0.1)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    mlp, norm = mlp.to(DEVICE, torch.bfloat16), norm.to(DEVICE, torch.bfloat16)
    x, residual = torch.randn(2, 3, 64, device=DEVICE).to(torch.bfloat16)

    def run(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        pending = PendingNorm(norm, x[:rows], residual[:rows])
        out = mlp(pending)
        return out, pending.residual

    expected = [run(1), run(3)]  # torch code
    install_fused_kernels(mlp)
    install_fused_kernels(norm)
    calls = []
    for module in (norm, mlp.act_fn):
        kernel = module.kernel
        module.set_kernel(lambda *a, k=kernel, m=module: calls.append(type(m).__name__) or k(*a))
    got = [run(1), run(3)]
    assert calls == ["RMSNorm", "SiluAndMul"]  # the three-row run only
    # Four roundings to bf16 in a row (sum, norm, projection, activation), which Triton's
    # interpreter truncates where torch and the GPU round to nearest.
    bound = tolerance(torch.bfloat16) * (1 if ON_GPU else 2)
    for (out, res), (ref_out, ref_res) in zip(got, expected):
        assert rel_error(res, ref_res) < bound and rel_error(out, ref_out) < bound
    pending = PendingNorm(norm, x[:1], residual[:1])
    mlp(pending)
    with pytest.raises(RuntimeError, match="projected once"):
        mlp(pending)
    # Against the same row through the separate kernels (the norm's switched off).
    monkeypatch.setattr(fused_layers, "_gemv_norm_on", lambda: False)
    calls.clear()
    out, res = run(1)
    assert calls == ["RMSNorm"] and torch.equal(res, got[0][1])
    if ON_GPU:
        assert rel_error(out, got[0][0]) < tolerance(torch.bfloat16) / 10
    else:
        assert torch.equal(out, got[0][0])


@pytest.mark.parametrize(
    "config_class, overrides",
    [("LlamaConfig", {}), ("Qwen3Config", {"head_dim": 16})],
    ids=["llama", "qwen3"],
)
def test_one_row_decodes_on_fused_kernels_match_transformers(
    tmp_path, config_class: str, overrides: dict
) -> None:
    """A whole Llama / Qwen3 on the platform's layer kernels (attention on the CPU
    backend): each decode step of one row fuses every block's norms into its GEMVs, and
    the logits stay transformers' (prefill rows take the separate kernels)."""
    from model_utils import PagedRunner
    from pagedlm.model_executor.loader import load_model
    from tiny_checkpoints import model_config, save_with_reference_logits

    prompts, expected = save_with_reference_logits(tmp_path, config_class, overrides)
    model = load_model(model_config(tmp_path, 128), torch.device(DEVICE))
    install_fused_kernels(model)
    runner = PagedRunner(model, len(prompts), max(map(len, prompts)), 16, None, DEVICE)
    for i, prompt in enumerate(prompts):
        split = max(1, len(prompt) - 3)
        got = runner.step([(i, 0, prompt[:split])])
        for position in range(split, len(prompt)):  # one row per step
            got += runner.step([(i, position, [prompt[position]])])
        assert rel_error(torch.cat(got).cpu(), expected[i]) < 1e-4
