"""W1's GEMMs: cuBLAS against a plain Triton tile GEMM (not a test; run it by hand).

    python tests/cuda/bench_gemm_tokens.py [--budget-s 120] [--rows 256 128]

W1 (qwen3-0.6b at batch 256) spends ~0.9 ms of a ~5.4 ms H200 step in cuBLAS GEMMs of
128-256 rows (session 20's profile), about 40% of the bf16 peak: the weights are small
(1,024-3,072 columns), and a 256-row product gives cuBLAS one wave of small tiles. This
times the four per-layer projections through ``torch.matmul`` and through a plain Triton
GEMM over a grid of tiles, unsplit and split over K (float32 atomics into a zeroed buffer,
then a cast: both counted), weights rotated over 28 copies (one per layer, past the L2),
us per call from a CUDA graph of 28 calls (``bench_timing``), and prints what the best tiles would save per
step. It decides whether a Triton GEMM for these row counts is worth writing; the engine
does not use this kernel.
"""

from __future__ import annotations

import argparse
import time

import torch
import triton
import triton.language as tl
from bench_timing import graph_us

LAYERS = 28
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
CONFIGS = [  # (block_m, block_n, block_k, warps, stages, split_k)
    (64, 64, 64, 4, 4, 1), (64, 128, 64, 4, 4, 1), (128, 64, 64, 4, 4, 1),
    (128, 128, 64, 4, 3, 1), (128, 128, 64, 8, 3, 1), (64, 256, 64, 8, 3, 1),
    (128, 256, 64, 8, 3, 1), (64, 64, 128, 4, 3, 1), (128, 64, 128, 4, 3, 1),
    (64, 128, 128, 4, 3, 1), (64, 64, 64, 4, 4, 2), (128, 64, 64, 4, 4, 2),
    (64, 128, 64, 4, 4, 2), (128, 128, 64, 8, 3, 2), (64, 64, 64, 4, 4, 4),
    (128, 64, 64, 4, 4, 4), (128, 128, 64, 8, 3, 4),
]  # fmt: skip


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, out_ptr, acc_ptr, M, N, K, K_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """out [M, N] = x [M, K] @ w [N, K]^T; with ``SPLIT`` > 1 each program adds its
    ``K_SPLIT`` columns' sums into the float32 ``acc``. ``STAGES`` slices in flight."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = tl.program_id(2) * K_SPLIT
    x_rows = x_ptr + rows[:, None] * K
    w_rows = w_ptr + cols[:, None] * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in tl.range(k_start, k_start + K_SPLIT, BLOCK_K, num_stages=STAGES):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=(rows < M)[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(tl.load(w_rows + k[None, :])), acc)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    at = rows[:, None] * N + cols[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(acc_ptr + at, acc, mask=mask, sem="relaxed")


def triton_linear(x, weight, out, acc, config) -> None:
    block_m, block_n, block_k, warps, stages, split = config
    (m, k), n = x.shape, weight.shape[0]
    if split > 1:
        acc.zero_()
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _gemm_kernel[grid](
        x, weight, out, acc, m, n, k, k // split, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT=split, STAGES=stages, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        out.copy_(acc)


def bench_shape(rows: int, n: int, k: int, deadline: float) -> tuple[float, float, list[str]]:
    """(cuBLAS us, best Triton us or cuBLAS's, one entry per tile timed)."""
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
    acc = torch.empty(rows, n, device="cuda", dtype=torch.float32)
    expected = (x.float() @ weights[0].float().T).to(torch.bfloat16).float()
    cublas = graph_us([lambda w=w: torch.matmul(x, w.T, out=out) for w in weights])[0]
    best, entries = cublas, []
    for config in CONFIGS:
        if time.monotonic() > deadline or k % (config[2] * config[5]):
            continue
        try:
            triton_linear(x, weights[0], out, acc, config)
            error = (out.float() - expected).abs().max().item()
            us = graph_us(
                [lambda w=w, c=config: triton_linear(x, w, out, acc, c) for w in weights]
            )[0]
        except Exception as failure:  # e.g. a tile past the shared memory
            entries.append(f"{config}: failed ({type(failure).__name__})")
            continue
        entries.append(
            f"{config}: {us:.1f}" + (f" (max error {error:.3f})" if error > 0.05 else "")
        )
        best = min(best, us)
    return cublas, best, entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 128])
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    for rows in args.rows:
        cublas_total = best_total = 0.0
        for name, (n, k) in SHAPES.items():
            cublas, best, entries = bench_shape(rows, n, k, deadline)
            cublas_total += cublas
            best_total += best
            print(
                f"{rows} rows, {name} {n}x{k}: cuBLAS {cublas:.1f} us, best {best:.1f}", flush=True
            )
            print("   " + " | ".join(entries), flush=True)
        saved = LAYERS * (cublas_total - best_total)
        print(
            f"{rows} rows: a layer's GEMMs {cublas_total:.1f} us in cuBLAS, {best_total:.1f} with "
            f"the best tiles ({saved:.0f} us per step less over {LAYERS} layers)",
            flush=True,
        )


if __name__ == "__main__":
    main()
