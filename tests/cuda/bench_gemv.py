"""The batch-1 GEMV's speed on llama-3-8b's projections (GPU only; run it by hand).

    python tests/cuda/bench_gemv.py [--sweep] [--budget-s 45] [--best-json best.json]

Each timing replays a CUDA graph of ``REPLAYS`` calls that rotate over copies of the weight
whose total exceeds the H200's 50 MB L2 several times, so every call reads its weight from
memory; median of 5 replays, us per call and the fraction of 4.8 TB/s the weight's bytes
make. Rows: ``F.linear`` (cuBLAS), the default tiles (``gemv_config``) and, with
``--sweep``, other (block_n, block_k, warps, pipeline stages, split-K) tiles. Every tiled
result is checked against the default's (relative error) and for repeatability (the calls
on the same weight copy must agree bitwise). ``--best-json`` writes the fastest correct
tiles per shape in the form ``PAGEDLM_GEMV_CONFIGS`` reads.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from bench_timing import graph_us

from pagedlm_cuda.kernels.gemv import GemvConfig, gemv, gemv_config

PROJECTIONS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
PEAK_BYTES_PER_S = 4.8e12
ROTATION_BYTES = 320 * 2**20
REPLAYS = 20

# Tiles for the few-program shapes (qkv, o): loop pipelining, split-K and occupancy.
SMALL_SWEEP = [
    GemvConfig(16, 1024, 8, 2),
    GemvConfig(16, 1024, 8, 3),
    GemvConfig(16, 512, 8, 2),
    GemvConfig(16, 512, 8, 3),
    GemvConfig(16, 512, 8, 4),
    GemvConfig(16, 512, 4, 3),
    GemvConfig(16, 512, 4, 4),
    GemvConfig(16, 256, 4, 3),
    GemvConfig(16, 256, 4, 4),
    GemvConfig(16, 256, 4, 6),
    GemvConfig(8, 512, 4, 3),
    GemvConfig(8, 512, 4, 4),
    GemvConfig(8, 1024, 4, 3),
    GemvConfig(32, 256, 8, 3),
    GemvConfig(32, 256, 8, 4),
    GemvConfig(32, 512, 8, 3),
    GemvConfig(16, 1024, 8, 1, 2),
    GemvConfig(16, 512, 8, 1, 2),
    GemvConfig(16, 512, 8, 1, 4),
    GemvConfig(16, 256, 4, 1, 2),
    GemvConfig(16, 256, 4, 1, 4),
    GemvConfig(16, 512, 8, 3, 2),
    GemvConfig(16, 256, 4, 4, 2),
    GemvConfig(16, 256, 4, 4, 4),
    GemvConfig(8, 512, 4, 3, 2),
    GemvConfig(8, 256, 4, 4, 2),
    GemvConfig(16, 512, 8, 1),
    GemvConfig(16, 256, 4, 1),
]
# Many-program shapes: does pipelining cost or help there?
LARGE_SWEEP = [
    GemvConfig(16, 256, 4, 3),
    GemvConfig(16, 256, 4, 4),
    GemvConfig(16, 512, 8, 3),
    GemvConfig(16, 512, 4, 3),
    GemvConfig(8, 512, 4, 4),
    GemvConfig(32, 256, 8, 4),
    GemvConfig(16, 1024, 8, 2),
]


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Copies of two random weights (even index: the first), enough to pass the L2."""
    base = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    count = max(2, -(-ROTATION_BYTES // (n * k * 2)))
    count += count % 2
    return [base[i % 2].clone() for i in range(count)]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bench_shape(name, n, k, configs, deadline, best: dict) -> None:
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    weights = weight_copies(n, k)
    gb = n * k * 2 / 1e9

    def line(label: str, us: float, extra: str = "") -> None:
        rate = n * k * 2 / (us * 1e-6)
        print(f"{name:8s} {label:26s} {us:8.2f} us {100 * rate / PEAK_BYTES_PER_S:5.1f}% {extra}")

    rotation = [weights[i % len(weights)] for i in range(REPLAYS)]
    calls = [lambda w=w: F.linear(x, w) for w in rotation]
    line("F.linear", graph_us(calls)[0])
    default = gemv_config(n, k)
    rows = [default] + [c for c in configs if c != default]
    ref = None
    fastest = None
    for config in rows:
        if time.monotonic() > deadline:
            print(f"{name:8s} budget spent; {len(rows)} tiles not all timed", flush=True)
            break
        calls = [lambda w=w, c=config: gemv(x, w, config=c) for w in rotation]
        try:
            us, outs = graph_us(calls)
        except Exception as error:  # a tile the compiler refuses (shared memory): report it
            print(f"{name:8s} {tuple(config)!s:26s} failed: {type(error).__name__}")
            continue
        same = all(torch.equal(outs[i], outs[i % 2]) for i in range(len(outs)))
        if ref is None:
            ref = outs[:2]
        err = max(rel_error(outs[i], ref[i]) for i in range(2))
        ok = same and err < 1e-2
        tag = "" if config != default else " (default)"
        line(
            str(tuple(config)), us, f"err {err:.1e} {'repeats' if same else 'NOT REPEATABLE'}{tag}"
        )
        if ok and (fastest is None or us < fastest[0]):
            fastest = (us, config)
    if fastest is not None:
        best[f"{n},{k}"] = list(fastest[1])
        print(f"{name:8s} best {tuple(fastest[1])} {fastest[0]:.2f} us ({gb:.3f} GB)", flush=True)
    del weights
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", nargs="*", default=list(PROJECTIONS))
    parser.add_argument("--budget-s", type=float, default=1e9, help="stop sweeping after this")
    parser.add_argument("--best-json", default=None)
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_s
    best: dict[str, list[int]] = {}
    for name in args.shapes:
        n, k = PROJECTIONS[name]
        configs = (SMALL_SWEEP if n * k <= 6144 * 4096 else LARGE_SWEEP) if args.sweep else []
        bench_shape(name, n, k, configs, deadline, best)
        if args.best_json:  # after every shape, so a run cut short keeps what it found
            with open(args.best_json, "w") as f:
                json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
