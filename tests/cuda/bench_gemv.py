"""The batch-1 GEMVs' speed on llama-3-8b's projections (GPU only; run it by hand).

    python tests/cuda/bench_gemv.py [--kinds bf16 fp8 gguf4 gguf4i8 gguf4h gguf8] [--sweep]
        [--configs N,K,W,S[,SPLIT] ...] [--budget-s 45] [--best-json best.json]

``--kinds``: which weights: ``bf16`` (``gemv``), ``fp8`` (``fp8_gemv``: E4M3 codes, a
scale per row), ``gguf4`` (``gguf_gemv`` on Q4_0 blocks), ``gguf4i8``
(``gguf_gemv_int8``, x rounded to int8, on the same blocks), ``gguf4h``
(``gguf_gemv_half``, float16 products, on the same blocks) and ``gguf8`` (``gguf_gemv`` on
Q8_0 blocks); the budget is per kind.

Each timing replays a CUDA graph of ``REPLAYS`` calls that rotate over copies of the weight
whose total exceeds the H200's 50 MB L2 several times, so every call reads its weight from
memory; median of 5 replays, us per call and the fraction of 4.8 TB/s the weight's bytes
make. Rows: ``F.linear`` (cuBLAS, bf16), the default tiles (``gemv_config``) and, with
``--sweep``, other (block_n, block_k, warps, pipeline stages[, split_k]) tiles. Every tiled
result is checked against the default's (relative error) and for repeatability (the calls
on the same weight copy must agree bitwise). ``--best-json`` writes the fastest correct
tiles per shape and kind in the form ``PAGEDLM_GEMV_CONFIGS`` reads (merged into the
file when it exists).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from bench_timing import graph_us

from pagedlm.model_executor.quantization.fp8 import quantize_rows
from pagedlm_cuda.kernels.fp8_gemv import fp8_gemv
from pagedlm_cuda.kernels.gemv import GemvConfig, gemv, gemv_config
from pagedlm_cuda.kernels.gguf_gemv import default_gemv_config, gguf_gemv, pack_blocks
from pagedlm_cuda.kernels.gguf_gemv_half import gguf_gemv_half
from pagedlm_cuda.kernels.gguf_gemv_int8 import gguf_gemv_int8

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

# Tiles for the few-program shapes (qkv, o): loop pipelining and occupancy.
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


# FP8 codes are one byte: the same bytes per slice take twice the columns.
FP8_SMALL_SWEEP = [
    GemvConfig(16, 1024, 8, 1),
    GemvConfig(16, 1024, 8, 2),
    GemvConfig(16, 1024, 8, 3),
    GemvConfig(16, 1024, 8, 4),
    GemvConfig(16, 2048, 8, 1),
    GemvConfig(16, 2048, 8, 2),
    GemvConfig(16, 2048, 8, 3),
    GemvConfig(32, 1024, 8, 2),
    GemvConfig(32, 1024, 8, 3),
    GemvConfig(16, 512, 4, 2),
    GemvConfig(16, 512, 4, 3),
    GemvConfig(16, 512, 4, 4),
    GemvConfig(16, 1024, 4, 3),
    GemvConfig(8, 1024, 4, 3),
    GemvConfig(8, 1024, 4, 4),
]
FP8_LARGE_SWEEP = [
    GemvConfig(16, 256, 4, 2),
    GemvConfig(16, 256, 4, 3),
    GemvConfig(16, 512, 4, 1),
    GemvConfig(16, 512, 4, 2),
    GemvConfig(16, 512, 4, 3),
    GemvConfig(16, 512, 4, 4),
    GemvConfig(16, 1024, 8, 3),
    GemvConfig(32, 512, 8, 3),
    GemvConfig(16, 1024, 4, 3),
]
# More warps over the same rows: on the H100 (session 18) the one-warp defaults left
# llama-3-8b's q/k/v, o and down projections (512-768 programs, ~4-6 warps per SM) at a
# third of the bandwidth, latency-bound; these trade instructions per weight (sm_90 SASS:
# 4.7 at one warp, 5.6-7.6 here) for warps in flight.
GGUF_MORE_WARPS = [
    GemvConfig(8, 512, 4, 3),
    GemvConfig(8, 256, 2, 3),
    GemvConfig(8, 256, 4, 3),
    GemvConfig(8, 1024, 4, 3),
    GemvConfig(4, 512, 2, 3),
    GemvConfig(16, 512, 4, 4),
]
# 4-bit codes: the GEMV reuses each thread's x over the rows it holds, so tiles with more
# rows per thread (more rows per program, or fewer warps) get a look.
# Split-K (session 21): each row block's columns over 2-8 programs, for the shapes whose
# few one-warp programs leave the GEMV latency-bound (q/k/v, o, down).
GGUF_SPLITS = [
    GemvConfig(8, 512, 1, 3, 2),
    GemvConfig(8, 512, 1, 3, 4),
    GemvConfig(8, 512, 1, 3, 8),
    GemvConfig(8, 256, 1, 3, 4),
    GemvConfig(8, 1024, 1, 3, 2),
    GemvConfig(8, 1024, 1, 3, 4),
    GemvConfig(16, 512, 2, 3, 2),
    GemvConfig(16, 512, 2, 3, 4),
    GemvConfig(8, 1024, 4, 3, 2),
    GemvConfig(8, 1024, 4, 3, 4),
    GemvConfig(4, 512, 1, 3, 4),
]
GGUF_SMALL_SWEEP = [
    *GGUF_SPLITS,
    GemvConfig(8, 512, 1, 3),
    GemvConfig(8, 512, 1, 4),
    GemvConfig(8, 1024, 1, 3),
    GemvConfig(16, 256, 1, 3),
    GemvConfig(16, 512, 1, 3),
    GemvConfig(16, 512, 2, 3),
    GemvConfig(16, 512, 2, 4),
    GemvConfig(16, 1024, 2, 3),
    GemvConfig(16, 512, 4, 3),
    GemvConfig(32, 256, 2, 3),
    GemvConfig(32, 512, 2, 3),
    GemvConfig(32, 512, 4, 3),
    GemvConfig(64, 512, 4, 3),
    *GGUF_MORE_WARPS,
]
GGUF_LARGE_SWEEP = [
    *GGUF_SPLITS,
    GemvConfig(8, 512, 1, 3),
    GemvConfig(16, 512, 1, 3),
    GemvConfig(16, 512, 2, 3),
    GemvConfig(16, 1024, 2, 3),
    GemvConfig(32, 512, 2, 3),
    GemvConfig(32, 512, 4, 3),
    GemvConfig(32, 1024, 4, 3),
    GemvConfig(64, 512, 4, 3),
    GemvConfig(64, 512, 4, 4),
    GemvConfig(128, 512, 8, 3),
    *GGUF_MORE_WARPS,
]
# The float16-product GEMV (session 33, H100): one stage and 1024-column slices won on every
# projection; these are the neighbourhood of its defaults, plus the exact GEMV's tiles.
GGUF_HALF_SMALL_SWEEP = [
    GemvConfig(8, 1024, 2, 1, 2),
    GemvConfig(8, 1024, 1, 1, 4),
    GemvConfig(8, 1024, 1, 1, 8),
    GemvConfig(8, 1024, 1, 1, 2),
    GemvConfig(8, 1024, 2, 1, 4),
    GemvConfig(16, 512, 2, 1, 4),
    GemvConfig(16, 512, 1, 1, 8),
    GemvConfig(8, 512, 1, 2, 8),
    GemvConfig(16, 512, 2, 3, 4),
    GemvConfig(8, 512, 1, 3, 4),
    GemvConfig(8, 1024, 1, 3, 2),
]
GGUF_HALF_LARGE_SWEEP = [
    GemvConfig(8, 1024, 2, 1),
    GemvConfig(8, 1024, 1, 1),
    GemvConfig(8, 512, 1, 1),
    GemvConfig(8, 512, 1, 2),
    GemvConfig(16, 512, 1, 1),
    GemvConfig(16, 512, 2, 1),
    GemvConfig(16, 1024, 4, 1),
    GemvConfig(8, 512, 1, 3),
    GemvConfig(16, 512, 1, 3),
]
SWEEPS = {
    "bf16": (SMALL_SWEEP, LARGE_SWEEP),
    "fp8": (FP8_SMALL_SWEEP, FP8_LARGE_SWEEP),
    "gguf4": (GGUF_SMALL_SWEEP, GGUF_LARGE_SWEEP),
    "gguf4i8": (GGUF_SMALL_SWEEP, GGUF_LARGE_SWEEP),
    "gguf4h": (GGUF_HALF_SMALL_SWEEP, GGUF_HALF_LARGE_SWEEP),
    "gguf8": (GGUF_SMALL_SWEEP, GGUF_LARGE_SWEEP),
}


class Kind:
    """One kind of weight: its copies (enough to pass the L2), bytes, call and defaults."""

    def __init__(self, name: str, n: int, k: int) -> None:
        self.name = name
        base = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
        if name == "bf16":
            weights: list = base
            self.nbytes = n * k * 2
        elif name == "fp8":
            weights = [tuple(t.contiguous() for t in quantize_rows(w)) for w in base]
            self.nbytes = n * k + n * 4
        else:  # Q4_0 blocks (4-bit codes, offset 8), or Q8_0 (gguf8: 8-bit, offset 128)
            levels, offset = (256, 128) if name == "gguf8" else (16, 8)
            weights = []
            for seed in range(2):
                gen = torch.Generator(device="cuda").manual_seed(seed)
                codes = torch.randint(
                    0, levels, (n, k), dtype=torch.uint8, device="cuda", generator=gen
                )
                scales = torch.full((n, k // 32), 0.003, device="cuda")
                weights.append(pack_blocks(codes, scales, -offset * scales, torch.device("cuda")))
            self.nbytes = weights[0].nbytes()
        del base
        count = max(2, -(-ROTATION_BYTES // self.nbytes))
        count += count % 2
        self.copies = [self._clone(weights[i % 2]) for i in range(count)]

    @staticmethod
    def _clone(weight):
        if isinstance(weight, torch.Tensor):
            return weight.clone()
        if isinstance(weight, tuple):
            return tuple(t.clone() for t in weight)
        fields = {f: getattr(weight, f) for f in weight.__dataclass_fields__}
        return type(weight)(**{
            f: v.clone() if isinstance(v, torch.Tensor) else v for f, v in fields.items()
        })  # fmt: skip

    def call(self, x, w, config=None):
        if self.name == "bf16":
            return gemv(x, w, config=config)
        if self.name == "fp8":
            return fp8_gemv(x, w[0], w[1], None, config)
        if self.name == "gguf4i8":
            return gguf_gemv_int8(x, w, None, config)
        if self.name == "gguf4h":
            return gguf_gemv_half(x, w, None, config)
        return gguf_gemv(x, w, None, config)

    def default(self, n: int, k: int) -> GemvConfig:
        if self.name in ("gguf4", "gguf8"):
            return default_gemv_config(self.copies[0])
        if self.name == "gguf4i8":
            return default_gemv_config(self.copies[0], int8=True)
        if self.name == "gguf4h":
            return default_gemv_config(self.copies[0], half=True)
        return gemv_config(n, k, self.name)

    def key(self, n: int, k: int) -> str:
        return f"{n},{k}" if self.name == "bf16" else f"{n},{k},{self.name}"


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def bench_shape(name, n, k, kind_name, configs, deadline, best: dict) -> None:
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    kind = Kind(kind_name, n, k)
    label_width = 26

    def line(label: str, us: float, extra: str = "") -> None:
        rate = kind.nbytes / (us * 1e-6)
        print(
            f"{name:8s} {kind_name:7s} {label:{label_width}s} {us:8.2f} us "
            f"{100 * rate / PEAK_BYTES_PER_S:5.1f}% {extra}",
            flush=True,
        )

    rotation = [kind.copies[i % len(kind.copies)] for i in range(REPLAYS)]
    if kind_name == "bf16":
        calls = [lambda w=w: F.linear(x, w) for w in rotation]
        line("F.linear", graph_us(calls)[0])
    default = kind.default(n, k)
    rows = [default] + [c for c in configs if c != default]
    ref = None
    fastest = None
    for config in rows:
        if time.monotonic() > deadline:
            print(
                f"{name:8s} {kind_name} budget spent; {len(rows)} tiles not all timed", flush=True
            )
            break
        calls = [lambda w=w, c=config: kind.call(x, w, c) for w in rotation]
        try:
            us, outs = graph_us(calls)
        except Exception as error:  # a tile the compiler refuses (shared memory): report it
            print(f"{name:8s} {kind_name} {tuple(config)!s:26s} failed: {type(error).__name__}")
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
        best[kind.key(n, k)] = list(fastest[1])
        print(
            f"{name:8s} {kind_name} best {tuple(fastest[1])} {fastest[0]:.2f} us "
            f"({kind.nbytes / 1e9:.3f} GB)",
            flush=True,
        )
    kind.copies.clear()
    del rotation
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=["bf16"], choices=list(SWEEPS))
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", nargs="*", default=list(PROJECTIONS))
    parser.add_argument(
        "--budget-s", type=float, default=1e9, help="per kind: stop sweeping after this"
    )
    parser.add_argument("--best-json", default=None)
    parser.add_argument(
        "--splits-only", action="store_true", help="sweep only the split-K tiles (GGUF)"
    )
    parser.add_argument(
        "--configs", nargs="+", default=None, metavar="N,K,W,S[,SPLIT]",
        help="with --sweep: these tiles instead of the kind's sweep list",
    )  # fmt: skip
    args = parser.parse_args()
    best: dict[str, list[int]] = {}
    if args.best_json and os.path.exists(args.best_json):
        with open(args.best_json) as f:
            best = json.load(f)
    for kind_name in args.kinds:
        deadline = time.monotonic() + args.budget_s
        small, large = SWEEPS[kind_name]
        for name in args.shapes:
            n, k = PROJECTIONS[name]
            configs = (small if n * k <= 6144 * 4096 else large) if args.sweep else []
            if args.sweep and args.configs:
                configs = [GemvConfig(*map(int, c.split(","))) for c in args.configs]
            if args.splits_only:
                configs = [c for c in configs if c.split_k > 1]
            bench_shape(name, n, k, kind_name, configs, deadline, best)
            if args.best_json:  # after every shape, so a run cut short keeps what it found
                with open(args.best_json, "w") as f:
                    json.dump(best, f, indent=1)


if __name__ == "__main__":
    main()
