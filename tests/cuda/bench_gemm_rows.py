"""Few-row GEMM speed on the GPU against cuBLAS and the one-row GEMV (not a test; run it by
hand).

    python tests/cuda/bench_gemm_rows.py [--rows 5 32] [--shapes qkv o] [--sweep]

For each projection of llama-3-8b (and qwen3-0.6b's with ``--shapes q3_qkv ...``) times
``F.linear`` at ``--rows`` rows, the one-row GEMV at one row and ``gemm_rows`` with its
default tiles (gate/up shapes also with the SiLU epilogue against the two kernels), each
from a CUDA graph of 24 calls rotating over weight copies that pass the L2; ``--sweep``
adds every tile of ``SWEEP`` (weight rows per program, columns per slice, warps, stages,
split) with its error against float32.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from bench_timing import graph_us

from pagedlm_cuda.kernels import silu_and_mul
from pagedlm_cuda.kernels.gemm_rows import GemmRowsConfig, gemm_rows, gemm_rows_config
from pagedlm_cuda.kernels.gemv import gemv

SHAPES = {
    "qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
    "lm_head": (128256, 4096), "q3_qkv": (4096, 1024), "q3_o": (1024, 2048),
    "q3_gate_up": (6144, 1024), "q3_down": (1024, 3072), "q3_lm_head": (151936, 1024),
}  # fmt: skip
SWEEP = [GemmRowsConfig(64, 128, 4, s, split) for s in (3, 4, 6) for split in (1, 2, 4)]
SWEEP += [GemmRowsConfig(64, 256, 4, 3, split) for split in (1, 2, 4)]
SWEEP += [GemmRowsConfig(128, 128, 8, 4, split) for split in (1, 2, 4)]
SWEEP += [GemmRowsConfig(64, 64, 4, s, split) for s in (4, 6) for split in (2, 4, 8)]
SWEEP += [GemmRowsConfig(64, 128, 4, s, 8) for s in (2, 3)]
WIDE_SWEEP = [GemmRowsConfig(64, 64, 4, 4, split) for split in (1, 2, 4, 8)]
WIDE_SWEEP += [GemmRowsConfig(64, 128, 4, 3, split) for split in (1, 2, 4, 8)]
WIDE_SWEEP += [GemmRowsConfig(64, 128, 4, 4, split) for split in (1, 4)]
WIDE_SWEEP += [GemmRowsConfig(128, 64, 8, 4, split) for split in (1, 2)]
WIDE_SWEEP += [GemmRowsConfig(128, 128, 8, 3, split) for split in (1, 2)]
"""Tiles for more than 16 rows (``--rows 32 64 128``): x's slices are wider than the
weight's there, so narrower slices and fewer stages fit the shared memory."""
REPLAYS = 24


def bench_shape(name: str, rows: int, sweep: bool) -> None:
    n, k = SHAPES[name]
    copies = max(1, (400 * 2**20) // (n * k * 2))
    weights = [(torch.randn(n, k, device="cuda") / k**0.5).bfloat16() for _ in range(copies)]
    rotation = [weights[i % copies] for i in range(REPLAYS)]
    x = torch.randn(rows, k, device="cuda").bfloat16()
    reference = x.float() @ weights[0].float().T

    def timed(fn) -> float:
        return graph_us([lambda w=w: fn(w) for w in rotation])[0]

    cublas = timed(lambda w: F.linear(x, w))
    one_row = timed(lambda w: gemv(x[:1], w))
    default = timed(lambda w: gemm_rows(x, w))
    print(
        f"{name} {n}x{k}, {rows} rows: F.linear {cublas:.2f} us, gemm_rows {default:.2f} "
        f"({gemm_rows_config(n, k, rows)}), one-row GEMV {one_row:.2f}",
        flush=True,
    )
    if name.endswith("gate_up"):
        two = timed(lambda w: silu_and_mul(gemm_rows(x, w)))
        fused = timed(lambda w: gemm_rows(x, w, silu_and_mul=True))
        print(f"  then silu_and_mul: two kernels {two:.2f} us, epilogue {fused:.2f}", flush=True)
    for config in (SWEEP if rows <= 16 else WIDE_SWEEP) if sweep else []:
        try:
            out = gemm_rows(x, weights[0], config=config)
        except Exception as error:  # a tile that does not fit (Triton's OutOfResources)
            print(f"  {tuple(config)}: {type(error).__name__}", flush=True)
            continue
        error = ((out.float() - reference).norm() / reference.norm()).item()
        us = timed(lambda w, c=config: gemm_rows(x, w, config=c))
        print(f"  {tuple(config)}: {us:.2f} us (error {error:.1e})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[5])
    parser.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate_up", "down", "lm_head"])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    for rows in args.rows:
        for name in args.shapes:
            bench_shape(name, rows, args.sweep)


if __name__ == "__main__":
    main()
