"""Few-row linear layers on the GPU (not a test; run it by hand).

    python tests/cuda/bench_gemv_rows.py [--sweep] [--rows 1 2 3 5 8] [--output-json F]

Times Llama-3-8B's five projections (bf16) at each row count through ``F.linear``
(cuBLAS), the one-row GEMV (``gemv.py``, at one row) and the few-row tensor-core GEMV
(``gemv_rows.py``, its default tile configuration), each from a CUDA graph of
``LAUNCHES`` calls rotating over copies of the weight that together exceed the L2 several
times, so every call reads its weight from memory. Prints us per call.

``--sweep`` also times every configuration of ``SWEEP`` (BLOCK_N x BLOCK_K x warps x
stages) at the sweep's row counts and prints the best few per (projection, rows); the
configurations are compiled first in ``--compile-jobs`` processes sharing Triton's cache.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
from bench_timing import graph_us

from pagedlm_cuda.kernels.gemv import gemv
from pagedlm_cuda.kernels.gemv_rows import GemvRowsConfig, gemv_rows, gemv_rows_config

PROJECTIONS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
"""name -> (out_features, in_features) of Llama-3-8B's fused projections and LM head."""

L2_DEFEAT_BYTES = 512 * 2**20
LAUNCHES = 20

# (BLOCK_N, BLOCK_K, warps, stages); shared memory per program is about
# (BLOCK_N + 16) * BLOCK_K * 2 bytes per stage, at most ~227 KB on the H200.
SWEEP = [
    GemvRowsConfig(*c)
    for c in (
        (16, 128, 4, 4), (16, 128, 4, 8), (16, 256, 4, 3), (16, 256, 4, 4), (16, 256, 4, 6),
        (16, 256, 8, 4), (16, 512, 4, 3), (16, 512, 4, 4), (16, 512, 8, 4), (16, 512, 8, 5),
        (16, 1024, 4, 3), (16, 1024, 8, 3),
        (32, 128, 4, 6), (32, 256, 4, 3), (32, 256, 4, 4), (32, 256, 8, 4), (32, 512, 4, 3),
        (32, 512, 8, 3),
        (64, 64, 4, 8), (64, 128, 4, 4), (64, 128, 4, 6), (64, 128, 8, 4), (64, 256, 4, 3),
        (64, 256, 8, 3),
        (128, 64, 4, 6), (128, 128, 4, 4), (128, 128, 8, 4),
    )
]  # fmt: skip


def rotated_weights(n: int, k: int) -> list[torch.Tensor]:
    """Copies of one random bf16 weight totalling at least ``L2_DEFEAT_BYTES``."""
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    copies = max(2, -(-L2_DEFEAT_BYTES // weight.nbytes))
    return [weight] + [weight.clone() for _ in range(copies - 1)]


def time_kernel(kernel: Callable, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    rotation = [weights[i % len(weights)] for i in range(LAUNCHES)]
    return graph_us([lambda w=w: kernel(x, w) for w in rotation])[0]


def check(x: torch.Tensor, weight: torch.Tensor, config: GemvRowsConfig | None) -> float:
    """Relative error of the few-row GEMV against a float32 product."""
    ref = x.float() @ weight.float().T
    out = gemv_rows(x, weight, config=config).float()
    return ((out - ref).norm() / ref.norm()).item()


def compile_configs(configs: list[GemvRowsConfig]) -> int:
    """Compiles ``configs`` (in a worker process) into Triton's on-disk cache: small
    shapes with the same specialization as the timed ones (every size a multiple of 16,
    a row count that is not); returns how many compiled."""
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    done = 0
    for config in configs:
        try:
            gemv_rows(x, weight, config=config)
            done += 1
        except Exception as error:  # out of shared memory: the sweep skips it too
            print(f"  {tuple(config)}: {type(error).__name__}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(configs: list[GemvRowsConfig], jobs: int) -> None:
    start = time.perf_counter()
    context = multiprocessing.get_context("spawn")
    chunks = [configs[i::jobs] for i in range(jobs)]
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        compiled = sum(pool.map(compile_configs, chunks))
    print(f"compiled {compiled}/{len(configs)} configs in {jobs} processes: "
          f"{time.perf_counter() - start:.1f} s", flush=True)  # fmt: skip


def bench_projection(name: str, rows_list: list[int], sweep_rows: list[int]) -> dict:
    n, k = PROJECTIONS[name]
    weights = rotated_weights(n, k)
    result: dict = {"default": {}, "sweep": {}}
    default = gemv_rows_config(n)
    cells = []
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        row = {
            "F.linear": time_kernel(lambda x, w: F.linear(x, w), x, weights),
            "gemv_rows": time_kernel(gemv_rows, x, weights),
            "error": check(x, weights[0], None),
        }
        if rows == 1:
            row["gemv"] = time_kernel(gemv, x, weights)
        result["default"][rows] = row
        cells.append(
            f"{rows}: cuBLAS {row['F.linear']:6.1f} rows {row['gemv_rows']:6.1f}"
            + (f" gemv {row['gemv']:6.1f}" if rows == 1 else "")
        )
    print(f"{name:8s} {n}x{k} default {tuple(default)} | " + " | ".join(cells), flush=True)
    for rows in sweep_rows:
        if rows > 1:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            times = {}
            for config in SWEEP:
                try:
                    times[config] = time_kernel(
                        lambda x, w, c=config: gemv_rows(x, w, config=c), x, weights
                    )
                except Exception:  # out of resources
                    continue
            best = sorted(times, key=times.get)[:4]
            result["sweep"][rows] = {str(tuple(c)): us for c, us in times.items()}
            print(f"  sweep {name} {rows} rows: " + ", ".join(
                f"{tuple(c)} {times[c]:.1f}" for c in best
            ), flush=True)  # fmt: skip
    del weights
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 5, 8])
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=None,
                        help="row counts the sweep times (default: --rows)")  # fmt: skip
    parser.add_argument("--projections", nargs="+", default=list(PROJECTIONS))
    parser.add_argument("--compile-jobs", type=int, default=8)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args()
    if args.sweep and args.compile_jobs > 1:
        precompile(SWEEP, args.compile_jobs)
    sweep_rows = (args.sweep_rows or args.rows) if args.sweep else []
    results = {}
    for name in args.projections:
        results[name] = bench_projection(name, args.rows, sweep_rows)
        if args.output_json:
            with open(args.output_json, "w") as file:
                json.dump(results, file, indent=1)


if __name__ == "__main__":
    main()
