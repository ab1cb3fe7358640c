"""``triton_env``'s speed-ups of Triton's interpreter compute what the interpreter does:
a custom reduction folded a slice at a time gives the element-at-a-time fold's bits, and a
kernel's helpers called without patching the language again see it patched."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton_env import ON_GPU

pytestmark = pytest.mark.skipif(ON_GPU, reason="interpreter patches: the CPU only")


@triton.jit
def _half_sum(a, b):
    return (a + b).to(tl.float16).to(tl.float32)


@triton.jit
def _max_first(a, i, b, j):
    take_b = b > a
    return tl.where(take_b, b, a), tl.where(take_b, j, i)


@triton.jit
def _reduce_kernel(x_ptr, sums_ptr, max_ptr, index_ptr, R: tl.constexpr, C: tl.constexpr):
    rows = tl.arange(0, R)[:, None]
    cols = tl.arange(0, C)[None, :]
    x = tl.load(x_ptr + rows * C + cols)
    tl.store(sums_ptr + tl.arange(0, R), tl.reduce(x, 1, _half_sum))
    indices = tl.broadcast_to(cols, (R, C))
    best, where = tl.reduce((x, indices), 1, _max_first)
    tl.store(max_ptr + tl.arange(0, R), best)
    tl.store(index_ptr + tl.arange(0, R), where)


def _reduce(x: torch.Tensor):
    sums = torch.empty(x.shape[0])
    best = torch.empty(x.shape[0])
    where = torch.empty(x.shape[0], dtype=torch.int32)
    _reduce_kernel[(1,)](x, sums, best, where, R=x.shape[0], C=x.shape[1])
    return sums, best, where


def test_a_custom_reduction_gives_the_element_at_a_time_bits(monkeypatch) -> None:
    from triton.runtime import interpreter

    torch.manual_seed(0)
    x = torch.randn(4, 16) * 300
    x[1, 3] = x[1, 9] = 1e4  # a tie: the first index wins
    fast = _reduce(x)
    slow_reduce = interpreter.ReduceOps.generic_reduce.original
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", slow_reduce)
    slow = _reduce(x)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))
    sums = x[:, 0].clone()
    for column in range(1, x.shape[1]):  # left to right, rounded to float16 at each step
        sums = (sums + x[:, column]).half().float()
    assert torch.equal(fast[0], sums)
    assert torch.equal(fast[1], x.max(dim=1).values) and fast[2][1].item() == 3


@triton.jit
def _twice(v):
    return v * 2.0


@triton.jit
def _helpers_kernel(x_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, _twice(_twice(_twice(tl.load(x_ptr + i)))))


def test_helpers_do_not_patch_the_language_again(monkeypatch) -> None:
    from triton.runtime import interpreter

    patches = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(
        interpreter, "_patch_builtin", lambda *args: patches.append(1) or original(*args)
    )
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    _helpers_kernel[(2,)](x, out, N=8)
    once = len(patches)
    assert torch.equal(out, x * 8)
    _helpers_kernel[(1,)](x, out, N=8)  # a second launch patches (and restores) anew
    assert len(patches) == 2 * once
    assert tl.core.is_builtin(tl.load)  # the language is restored after each launch
