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
    """Triton 3.6's interpreter rounds float -> float8 E4M3 without carrying into the
    exponent (31.0 becomes 16, 1.97 becomes 1.0), unlike the GPU's conversion; round
    those through torch (round to nearest even, as the hardware does)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp
    if getattr(original, "_pagedlm_patched", False):
        return

    def patched(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16):
            values = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32))
            data = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(data, dst_type.scalar)
        return original(self, src, dst_type, rounding_mode)

    patched._pagedlm_patched = True
    builder.create_fp_to_fp = patched


def _patch_interpreter_dot() -> None:
    """Two fixes to Triton 3.6's interpreter ``tl.dot``, which is numpy's ``matmul``:
    - it holds bfloat16 as its 16-bit patterns (numpy has no bfloat16) and multiplies
      those integers; bfloat16 operands are widened to float32 first, as the tensor cores'
      products are exact and summed in float32;
    - numpy's BLAS sums a row's products in an order that can depend on the row's place in
      the tile (OpenBLAS's AVX-512 kernels on Zen 5: 10 of 16 rows of a 16 x 64 x 32 float32
      product change bits when moved to row 0), where a GPU's dot gives each row the same
      order. Batch-invariant kernels rely on that, so float dots go through ``einsum``'s
      own loop, which sums every output element in the same order wherever its row is."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, "_pagedlm_patched", False):
        return

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        bits = np.ascontiguousarray(handle.data).astype(np.uint32) << 16
        return interpreter.TensorHandle(bits.view(np.float32), tl.float32)

    def patched(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = widened(a), widened(b)
        fp8 = any(h.dtype.primitive_bitwidth == 8 and h.dtype.is_floating() for h in (a, b))
        if fp8 or not (a.dtype.is_floating() and b.dtype.is_floating()):
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data, b.data, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    patched._pagedlm_patched = True
    builder.create_dot = patched


def _patch_interpreter_nested_calls() -> None:
    """Triton 3.6's interpreter patches ``triton.language`` again (``inspect.getmembers``
    over its modules, ~1 ms) at every call of a ``@triton.jit`` helper inside a kernel, a
    third of the kernel tests' time. Within a launch whose patch already covers the
    helper's language modules, the repeat changes nothing (the builtins are wrapped once,
    the rest is set to the same closures): skip it. A launch's own patch, and a helper's
    whose modules the launch has not patched, run as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang
    if getattr(original, "_pagedlm_patched", False):
        return
    live: set[int] = set()  # ids of the language modules patched by the running launch
    launch = {"active": False}
    languages_of: dict[object, frozenset[int]] = {}

    class _NoChanges:
        def restore(self) -> None:
            pass

    def patched(fn):
        languages = languages_of.get(fn)
        if languages is None:
            languages = frozenset(
                id(value) for value in fn.__globals__.values() if value is tl or value is tl.core
            )
            languages_of[fn] = languages
        if launch["active"] and languages and languages <= live:
            return _NoChanges()
        scope = original(fn)
        live.update(languages)
        if not launch["active"]:  # the launch's own patch: ends with its restore
            launch["active"] = True
            restore = scope.restore

            def restore_and_end() -> None:
                try:
                    restore()
                finally:
                    live.clear()
                    launch["active"] = False

            scope.restore = restore_and_end
        return scope

    patched._pagedlm_patched = True
    interpreter._patch_lang = patched


def _patch_interpreter_generic_reduce() -> None:
    """Triton 3.6's interpreter reduces with a custom combine function one element at a
    time (a Python call per element: the float16-lane GEMV's emulated sums spent 90% of its
    time there). Fold along the axis a whole slice at a time instead: each output element
    sees the same combines in the same order (first element, then left to right), so the
    results are the same bits."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    original = ops.generic_reduce
    if getattr(original, "_pagedlm_patched", False):
        return

    def patched(self, input):
        original_axis = self.axis
        input, axis = self.unravel(input, self.axis)
        datas = [arg.handle.data for arg in input]
        if datas[0].shape[axis] == 0:
            return original(self, input)
        out_shape = datas[0].shape[:axis] + datas[0].shape[axis + 1 :]

        def slice_at(i: int) -> list:
            return [self.to_tensor(np.take(d, i, axis=axis), a.dtype) for d, a in zip(datas, input)]

        def as_output(value, d: np.ndarray) -> np.ndarray:
            value = np.asarray(value.handle.data if isinstance(value, tl.tensor) else value)
            if value.size == int(np.prod(out_shape)):
                return value.reshape(out_shape).astype(d.dtype)
            return np.broadcast_to(value, out_shape).astype(d.dtype)

        acc = slice_at(0)
        for i in range(1, datas[0].shape[axis]):
            result = self.combine_fn.fn(*acc, *slice_at(i))
            result = result if isinstance(result, tuple) else (result,)
            acc = [
                self.to_tensor(as_output(r, d), a.dtype) for r, d, a in zip(result, datas, input)
            ]
        ret = []
        for value, d, arg in zip(acc, datas, input):
            data = as_output(value, d)
            if self.keep_dims:
                if original_axis is not None:
                    data = np.expand_dims(data, axis)
                else:
                    for _ in range(d.ndim):
                        data = np.expand_dims(data, 0)
            elif original_axis is None:
                data = data.item()
            ret.append(self.to_tensor(data, arg.dtype))
        return ret

    patched._pagedlm_patched = True
    patched.original = original
    ops.generic_reduce = patched


if not ON_GPU:
    _patch_interpreter_index()
    _patch_interpreter_fp8_rounding()
    _patch_interpreter_dot()
    _patch_interpreter_nested_calls()
    _patch_interpreter_generic_reduce()

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
