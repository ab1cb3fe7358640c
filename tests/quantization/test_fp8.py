"""FP8 E4M3 weights on CPU: the quantize/dequantize round trip, the reference kernel, and
``quantization="fp8"`` on a float checkpoint end to end (E4M3 storage, emulated compute).

Tolerances. E4M3 has 3 mantissa bits: a code in the normal range (|code| >= 2^-6) rounds
to within 2^-4 of itself, a subnormal one to within half its step of 2^-9; in weight units
(``scale = absmax / 448`` per row) that is ``max(|w| 2^-4, scale 2^-10)``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_utils import full_logits
from pagedlm import LLM, SamplingParams
from pagedlm.model_executor.layers.linear import ColumnParallelLinear
from pagedlm.model_executor.layers.vocab_embedding import ParallelLMHead
from pagedlm.model_executor.loader import load_model
from pagedlm.model_executor.quantization import fp8
from pagedlm_cpu.attention import CpuSdpaBackend
from tiny_checkpoints import model_config, random_prompts, save_random_model


def test_round_trip_stays_within_e4m3_rounding() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 256) * torch.logspace(-3, 3, 64)[:, None]  # rows of any magnitude
    codes, scales = fp8.quantize_rows(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.shape == (64, 1)
    back = fp8.dequantize(codes, scales)
    amax = x.abs().amax(dim=1, keepdim=True)
    torch.testing.assert_close(back.abs().amax(dim=1, keepdim=True), amax)  # absmax -> 448
    bound = torch.maximum(x.abs() * 2**-4, scales * 2**-10)
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_zero_rows_and_static_scales_saturate_instead_of_nan() -> None:
    codes, scales = fp8.quantize_rows(torch.zeros(2, 32))
    assert torch.equal(fp8.dequantize(codes, scales), torch.zeros(2, 32))
    x = torch.tensor([[1.0, -1000.0, 3.0]])
    codes, x_scales = fp8.quantize_activations(x, torch.tensor([1.0]))
    assert codes.float().tolist() == [[1.0, -448.0, 3.0]] and x_scales.tolist() == [[1.0]]


@pytest.mark.parametrize("static", [False, True])
def test_reference_kernel_computes_the_dequantized_product(static: bool) -> None:
    torch.manual_seed(1)
    layer = ColumnParallelLinear(96, 48, bias=True)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    float_weight = layer.weight.detach().clone()
    fp8.quantize_layer(layer)
    if static:
        layer.input_scale = torch.nn.Parameter(torch.tensor([0.02]), requires_grad=False)
    x = torch.randn(5, 96)
    x_codes, x_scales = fp8.quantize_activations(x, layer.input_scale if static else None)
    expected = F.linear(
        fp8.dequantize(x_codes, x_scales),
        fp8.dequantize(layer.weight, layer.weight_scale),
        layer.bias,
    )
    out = layer.apply_linear(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # And close to the float layer: per-token activations plus per-row weights cost a few %.
    float_out = F.linear(x, float_weight, layer.bias)
    relative = (out - float_out).norm() / float_out.norm()
    assert relative < (0.08 if static else 0.05)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp8-llama")
    save_random_model(path, "LlamaConfig", {"architectures": ["LlamaForCausalLM"]})
    return path


def test_quantize_at_load_keeps_e4m3_weights_and_close_logits(checkpoint: Path) -> None:
    float_config = model_config(checkpoint)
    from dataclasses import replace

    quantized = load_model(replace(float_config, quantization="fp8"), torch.device("cpu"))
    reference = load_model(float_config, torch.device("cpu"))
    layers = [m for m in quantized.modules() if fp8.is_fp8_layer(m)]
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down per layer
    assert all(not isinstance(m, ParallelLMHead) for m in layers)
    assert all(isinstance(m.kernel, fp8.Fp8ReferenceLinear) for m in layers)
    backend = CpuSdpaBackend(torch.device("cpu"))
    arch = float_config.arch
    with torch.no_grad():
        for prompt in random_prompts()[:3]:
            got = full_logits(quantized, arch, backend, prompt)
            want = full_logits(reference, arch, backend, prompt)
            # Measured 0.05-0.09 on this model (W8A8 in 8 layers); a wrong scale gives > 0.5.
            assert ((got - want).norm() / want.norm()).item() < 0.15


def test_llm_runs_fp8_on_cpu_and_mostly_agrees_with_float(checkpoint: Path) -> None:
    prompts = random_prompts()
    params = SamplingParams(max_tokens=8, temperature=0.0)
    outputs = {}
    for quantization in (None, "fp8"):
        llm = LLM(str(checkpoint), skip_tokenizer_init=True, quantization=quantization,
                  dtype="float32", max_model_len=128, num_kv_blocks=64)  # fmt: skip
        requests = [{"prompt_token_ids": p} for p in prompts]
        outputs[quantization] = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
        del llm
    first = [a[0] == b[0] for a, b in zip(outputs[None], outputs["fp8"], strict=True)]
    # Greedy paths diverge once a near-tie flips; the first tokens mostly agree.
    assert sum(first) >= len(first) - 2


def test_moe_routers_stay_unquantized(tmp_path: Path) -> None:
    """As vLLM builds its MoE gates without a quantization config, ``quantization="fp8"``
    leaves the routers in the model's dtype (a router's rounding moves tokens to other
    experts) and quantizes the experts' and attention's layers."""
    from dataclasses import replace

    from pagedlm.model_executor.layers.moe import MoERouter

    save_random_model(
        tmp_path,
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    )
    model = load_model(replace(model_config(tmp_path), quantization="fp8"), torch.device("cpu"))
    routers = [m for m in model.modules() if isinstance(m, MoERouter)]
    assert routers and all(m.weight.dtype == torch.float32 for m in routers)
    assert any(fp8.is_fp8_layer(m) for m in model.modules())


def test_fp8_experts_compute_the_dequantized_product() -> None:
    """``FusedMoE.quantize_fp8``: E4M3 codes and per-row scales per expert, and each
    routed expert's products those of the dequantized weights (float32, one rounding)."""
    from pagedlm.model_executor.layers.moe import FusedMoE

    torch.manual_seed(2)
    layer = FusedMoE(num_experts=4, top_k=2, hidden_size=32, intermediate_size=24,
                     renormalize=True)  # fmt: skip
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0.0, 0.3)
    x = torch.randn(9, 32)
    float_out = layer(x)
    float_w13 = layer.w13.detach().clone()
    layer.quantize_fp8()
    assert layer.is_fp8 and layer.w13.dtype == layer.w2.dtype == fp8.FP8_DTYPE
    assert layer.w13_scale.shape == (4, 48) and layer.w2_scale.shape == (4, 32)
    w13 = fp8.dequantize(layer.w13, layer.w13_scale[..., None])
    w2 = fp8.dequantize(layer.w2, layer.w2_scale[..., None])
    bound = torch.maximum(float_w13.abs() * 2**-4, layer.w13_scale[..., None] * 2**-10)
    assert ((w13 - float_w13).abs() <= bound * (1 + 1e-6)).all()
    # The same routing (the router stays float), then each expert on dequantized weights.
    reference = FusedMoE(num_experts=4, top_k=2, hidden_size=32, intermediate_size=24,
                         renormalize=True)  # fmt: skip
    reference.load_state_dict({"gate.weight": layer.gate.weight, "w13": w13, "w2": w2}, strict=True)
    torch.testing.assert_close(layer(x), reference(x), rtol=1e-5, atol=1e-5)
    assert ((layer(x) - float_out).norm() / float_out.norm()).item() < 0.05
    with pytest.raises(ValueError, match="quantized to FP8 at load"):
        layer.w13.weight_loader(layer.w13, float_w13[0], 0, "gate")


def test_quantize_at_load_quantizes_moe_experts(tmp_path: Path) -> None:
    """``quantization="fp8"`` on a Mixtral- and a DeepSeek-shaped model: E4M3 experts
    (shared experts are linear layers: quantized as such), logits close to the float
    model's."""
    from dataclasses import replace

    from pagedlm.model_executor.layers.moe import FusedMoE

    save_random_model(
        tmp_path,
        "MixtralConfig",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    )
    float_config = model_config(tmp_path)
    quantized = load_model(replace(float_config, quantization="fp8"), torch.device("cpu"))
    reference = load_model(float_config, torch.device("cpu"))
    experts = [m for m in quantized.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.is_fp8 and m.w2.dtype == fp8.FP8_DTYPE for m in experts)
    float_bytes = sum(m.w13.numel() * 4 + m.w2.numel() * 4 for m in experts)
    fp8_bytes = sum(
        m.w13.numel() + m.w2.numel() + 4 * (m.w13_scale.numel() + m.w2_scale.numel())
        for m in experts
    )
    assert fp8_bytes < 0.3 * float_bytes
    backend = CpuSdpaBackend(torch.device("cpu"))
    with torch.no_grad():
        for prompt in random_prompts()[:3]:
            got = full_logits(quantized, float_config.arch, backend, prompt)
            want = full_logits(reference, float_config.arch, backend, prompt)
            assert ((got - want).norm() / want.norm()).item() < 0.15
