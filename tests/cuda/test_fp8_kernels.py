"""The FP8 GEMV and per-token quantization kernels against the torch reference
(``pagedlm.model_executor.quantization.fp8``); on the GPU also the ``_scaled_mm`` path of
``Fp8CudaLinear``. Under ``TRITON_INTERPRET=1`` on CPU without a GPU."""

from __future__ import annotations

import pytest
import torch
from triton_env import DEVICE, ON_GPU, rel_error

from pagedlm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedlm.model_executor.quantization import fp8
from pagedlm_cuda.kernels.fp8_gemv import fp8_gemv, quantize_per_token

# Rows not a multiple of the 16-row tile, columns not a multiple of the slice; the wider
# tile configurations (beyond 4k and 8k outputs) on the GPU only (slow in the interpreter).
# Marked cuda as well: run by the GPU's -m cuda, deselected (not skipped) on CPU.
_GPU_ONLY = [
    pytest.mark.cuda,
    pytest.mark.skipif(not ON_GPU, reason="thousands of programs: GPU only"),
]
SHAPES = [(40, 600), (96, 1100), pytest.param((5000, 64), marks=_GPU_ONLY),
          pytest.param((8200, 64), marks=_GPU_ONLY)]  # fmt: skip


def quantized_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    return fp8.quantize_rows(torch.randn(n, k, device=DEVICE) / k**0.5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_the_dequantized_product(shape: tuple[int, int], dtype: torch.dtype):
    n, k = shape
    codes, scales = quantized_weight(n, k, n + k)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    out = fp8_gemv(x, codes, scales, bias)
    # x is not rounded at batch 1: the reference is x times the dequantized weight.
    ref = x.double() @ fp8.dequantize(codes, scales).double().T + bias.double()
    assert out.shape == (1, n) and out.dtype == dtype
    assert rel_error(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_gemv_rejects_what_it_cannot_compute() -> None:
    codes, scales = quantized_weight(8, 32, 0)
    with pytest.raises(ValueError, match="one row"):
        fp8_gemv(torch.randn(2, 32, device=DEVICE), codes, scales)
    with pytest.raises(ValueError, match="features"):
        fp8_gemv(torch.randn(1, 16, device=DEVICE), codes, scales)


@pytest.mark.parametrize("shape", [(3, 100), (5, 4500), (1, 7)])
def test_per_token_quantization_matches_torch(shape: tuple[int, int]) -> None:
    torch.manual_seed(shape[1])
    x = torch.randn(*shape, device=DEVICE) * torch.logspace(-2, 2, shape[0], device=DEVICE)[:, None]
    x[0, :3] = 0.0
    codes, scales = quantize_per_token(x)
    want_codes, want_scales = fp8.quantize_rows(x)
    torch.testing.assert_close(scales, want_scales, rtol=1e-6, atol=0)
    # The kernel divides by the same float32 scale and rounds to nearest even, as torch.
    assert torch.equal(codes.float(), want_codes.float())
    zero_codes, zero_scales = quantize_per_token(torch.zeros(2, 40, device=DEVICE))
    assert torch.equal(fp8.dequantize(zero_codes, zero_scales), torch.zeros(2, 40, device=DEVICE))


@pytest.mark.parametrize("capability", [(9, 0), (8, 9)])  # row-wise scales, or scaled after
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("layer_class", [ColumnParallelLinear, RowParallelLinear])
def test_cuda_linear_matches_the_reference_at_every_row_count(
    static: bool, layer_class, capability: tuple[int, int], monkeypatch
) -> None:
    """On CPU, torch's own ``_scaled_mm`` (row-wise scales included) and the interpreted
    kernels stand in for the GPU's."""
    from pagedlm_cuda.quantized_linear import Fp8CudaLinear

    if not ON_GPU:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    elif torch.cuda.get_device_capability() < capability:
        pytest.skip(f"needs compute capability {capability}")
    torch.manual_seed(2)
    layer = layer_class(256, 384, bias=True).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    fp8.quantize_layer(layer)
    if static:
        layer.input_scale = torch.nn.Parameter(torch.tensor([0.01], device=DEVICE), False)
    reference = fp8.Fp8ReferenceLinear(layer)
    layer.set_kernel(Fp8CudaLinear(layer))
    for rows in (1, 2, 17):
        x = torch.randn(rows, 256, device=DEVICE, dtype=torch.bfloat16)
        out = layer.apply_linear(x)
        if rows == 1:  # the GEMV does not round x
            want = x.double() @ fp8.dequantize(layer.weight, layer.weight_scale).double().T
            want += layer.bias.double()
        else:
            want = reference(x)
        assert out.dtype == torch.bfloat16 and rel_error(out, want) < 1e-2, rows


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs an FP8 GPU")
def test_install_gives_every_fp8_layer_the_gpu_kernel() -> None:
    from pagedlm_cuda.quantized_linear import Fp8CudaLinear, install_fp8_kernels

    layers = [ColumnParallelLinear(64, 32).to(DEVICE) for _ in range(2)]
    fp8.quantize_layer(layers[0])
    assert install_fp8_kernels(torch.nn.Sequential(*layers)) == 1
    assert isinstance(layers[0].kernel, Fp8CudaLinear) and layers[1].kernel is None


def test_gpus_without_fp8_are_refused_with_the_fix(monkeypatch) -> None:
    from pagedlm_cuda import quantized_linear

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8.9 or newer.*A100 is 8.0"):
        quantized_linear.check_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    quantized_linear.check_fp8_device(torch.device("cuda"))
