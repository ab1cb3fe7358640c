"""Where the Triton kernel tests run: the GPU when there is one, else the interpreter.

Imported by each kernel test module before anything imports Triton: ``TRITON_INTERPRET``
is read when a kernel is decorated, so it must be set first.
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into ``int(array_of_shape_1)``, which numpy
    2.4 refuses; loop bounds computed from loaded values need it. Take the element."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_pagedlm_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pagedlm_patched = True
    interpreter._patch_lang_tensor = patched


def _patch_interpreter_fp8_rounding() -> None:
    """Triton 3.6's interpreter rounds float32 -> E4M3 wrongly where rounding up carries
    into the exponent (126.2 becomes 64, not 128); the GPU's conversion rounds to nearest
    even. Convert through torch, which does that too."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "_pagedlm_patched", False):
        return

    def patched(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
            values = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    patched._pagedlm_patched = True
    interpreter._convert_float = patched


if not ON_GPU:
    _patch_interpreter_index()
    _patch_interpreter_fp8_rounding()

DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (NaN anywhere counts as failure)."""
    out64, ref64 = out.double().cpu(), ref.double().cpu()
    if torch.isnan(out64).any():
        return float("inf")
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def tolerance(dtype: torch.dtype) -> float:
    # tf32 dots on GPU for float32 inputs land near 3e-4; bf16 operands near 1e-2.
    return {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
