"""Time each Llama-3-8B projection's LoRA delta at batch 1 and 64, old path against new.

``python tests/cuda/bench_lora_kernels.py [--rank 16] [--adapters 8] [--calls 16]``
(needs a GPU). Per projection and batch, from a CUDA graph of ``--calls`` calls that
cycle over enough copies of the weights (base and adapters) to defeat the 50 MB L2, as
decode steps read them:

- batch 1: ``gemv`` alone (the base), ``gemv`` + shrink + expand (the two-launch path,
  old), ``gemv_lora`` (one launch, new), and ``gemv_lora`` for a base-model token (slot
  -1: what the claims and counters cost alone). The LoRA cost is each minus the base.
- batch 64 (8 adapters round robin): ``F.linear`` alone and ``F.linear`` + shrink + expand,
  the path both old and new take there.

Before timing, the new kernel's result is checked against the two-launch path on the
projection's real shape.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # --tiny on CPU: the interpreter
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import triton_env  # noqa: F401

from pagedlm.lora.ops import LoRAStepState, SliceSpec, reference_delta
from pagedlm_cuda.kernels.gemv import gemv
from pagedlm_cuda.kernels.lora import TritonLoRAOps
from pagedlm_cuda.kernels.lora_fused import FusedScratch, base_config, gemv_lora

PROJECTIONS = {  # name: (in_features, output slice sizes)
    "qkv": (4096, [4096, 1024, 1024]),
    "o": (4096, [4096]),
    "gate_up": (4096, [14336, 14336]),
    "down": (14336, [4096]),
}
L2_BYTES = 50 * 2**20


def time_graph_us(fn, calls: int, replays: int = 20) -> float:
    """Microseconds per call of ``fn(i)`` for i in range(calls), replayed from one graph
    (on CPU, for ``--tiny``'s smoke run: one eager pass, wall clock)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        return (time.perf_counter() - start) * 1e6 / calls
    for i in range(calls):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def bench_projection(name: str, rank: int, adapters: int, calls: int, shrink_ks) -> None:
    in_features, sizes = PROJECTIONS[name]
    n = sum(sizes)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    slices = tuple(SliceSpec(s, size) for s, size in zip(starts, sizes, strict=True))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    copies = max(2, math.ceil(2 * L2_BYTES / (n * in_features * 2)))
    weights = [torch.randn(n, in_features, **kw) * in_features**-0.5 for _ in range(copies)]
    lora_as = [
        torch.randn(adapters, len(sizes) * rank, in_features, **kw) * in_features**-0.5
        for _ in range(copies)
    ]
    lora_bs = [torch.randn(adapters, n, rank, **kw) * 0.01 for _ in range(copies)]
    old = TritonLoRAOps(fuse_single_row=False)
    num_warps = base_config(n)[2]
    scratches = [
        FusedScratch(len(sizes) * rank, in_features, num_warps, device) for _ in range(copies)
    ]

    # Batch 1.
    x1 = torch.randn(1, in_features, **kw)
    slot1 = torch.tensor([3], dtype=torch.int32, device=device)
    base_slot = torch.tensor([-1], dtype=torch.int32, device=device)
    state1 = LoRAStepState(slot1)
    active = [True] * adapters

    fused = gemv_lora(x1, weights[0], None, lora_as[0], lora_bs[0], slot1, slices, scratches[0])
    two = gemv(x1, weights[0])
    old.add_lora(two, x1, lora_as[0], lora_bs[0], slices, state1, active)
    base = gemv(x1, weights[0])
    ref = base.double().cpu() + reference_delta(x1, lora_as[0], lora_bs[0], slices, slot1.cpu())

    def error(out):
        return ((out.double().cpu() - ref).norm() / (ref - base.double().cpu()).norm()).item()

    print(
        f"check {name:8s}: |out - float64 reference| / |delta|: new {error(fused):.2e},"
        f" old {error(two):.2e}",
        flush=True,
    )

    def base_call(i):
        gemv(x1, weights[i % copies])

    def old_call(i):
        c = i % copies
        out = gemv(x1, weights[c])
        old.add_lora(out, x1, lora_as[c], lora_bs[c], slices, state1, active)

    def new_call(i, slots=slot1, limit_registers=True):
        c = i % copies
        gemv_lora(
            x1, weights[c], None, lora_as[c], lora_bs[c], slots, slices, scratches[c],
            limit_registers,
        )  # fmt: skip

    t_base = time_graph_us(base_call, calls)
    t_old = time_graph_us(old_call, calls)
    t_new = time_graph_us(new_call, calls)
    t_new_base = time_graph_us(lambda i: new_call(i, base_slot), calls)
    t_new_free = time_graph_us(lambda i: new_call(i, slot1, False), calls)
    plan = scratches[0].plan
    print(
        f"batch  1 {name:8s} [{in_features} -> {n}] ({copies} copies): base GEMV {t_base:6.1f} us;"
        f" old +{t_old - t_base:5.1f} us (two launches); new +{t_new - t_base:5.1f} us"
        f" (one launch, {plan.items} shrink items of {plan.shrink_n}x{plan.shrink_k});"
        f" new at slot -1 +{t_new_base - t_base:5.1f} us;"
        f" new without the register limit +{t_new_free - t_base:5.1f} us",
        flush=True,
    )
    for shrink_k in shrink_ks:
        if shrink_k == plan.shrink_k:
            continue
        other = [
            FusedScratch(len(sizes) * rank, in_features, num_warps, device, shrink_k)
            for _ in range(copies)
        ]

        def sweep_call(i, other=other):
            c = i % copies
            gemv_lora(x1, weights[c], None, lora_as[c], lora_bs[c], slot1, slices, other[c])

        t = time_graph_us(sweep_call, calls)
        print(
            f"batch  1 {name:8s} new with shrink_k {shrink_k:4d} ({other[0].plan.items} items):"
            f" +{t - t_base:5.1f} us",
            flush=True,
        )

    # Batch 64, 8 adapters round robin: the same path old and new.
    x64 = torch.randn(64, in_features, **kw)
    slots64 = torch.arange(64, dtype=torch.int32, device=device) % adapters
    state64 = LoRAStepState(slots64)

    def base64(i):
        F.linear(x64, weights[i % copies])

    def lora64(i):
        c = i % copies
        out = F.linear(x64, weights[c])
        old.add_lora(out, x64, lora_as[c], lora_bs[c], slices, state64, active)

    t64_base, t64 = time_graph_us(base64, calls), time_graph_us(lora64, calls)
    print(
        f"batch 64 {name:8s}: base GEMM {t64_base:6.1f} us; shrink+expand +{t64 - t64_base:5.1f}"
        " us (old = new: the two-launch path)",
        flush=True,
    )


def bench_chain(num_layers: int, rank: int, adapters: int) -> None:
    """A batch-1 decode step's linear layers: ``num_layers`` x (qkv, o, gate_up, down), each
    layer its own weights, in one graph: base alone, base + two launches, fused."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    layers = []
    for _ in range(num_layers):
        for name, (in_features, sizes) in PROJECTIONS.items():
            n = sum(sizes)
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            slices = tuple(SliceSpec(s, size) for s, size in zip(starts, sizes, strict=True))
            weight = torch.randn(n, in_features, **kw) * in_features**-0.5
            lora_a = torch.randn(adapters, len(sizes) * rank, in_features, **kw) * 0.02
            lora_b = torch.randn(adapters, n, rank, **kw) * 0.01
            scratch = FusedScratch(len(sizes) * rank, in_features, base_config(n)[2], device)
            layers.append(
                (name, torch.randn(1, in_features, **kw), weight, lora_a, lora_b, slices, scratch)
            )
    slot = torch.tensor([3], dtype=torch.int32, device=device)
    state = LoRAStepState(slot)
    old = TritonLoRAOps(fuse_single_row=False)
    active = [True] * adapters

    def base(i):
        _, x, weight, *_ = layers[i]
        gemv(x, weight)

    def two_launches(i):
        _, x, weight, lora_a, lora_b, slices, _ = layers[i]
        old.add_lora(gemv(x, weight), x, lora_a, lora_b, slices, state, active)

    def fused(i):
        _, x, weight, lora_a, lora_b, slices, scratch = layers[i]
        gemv_lora(x, weight, None, lora_a, lora_b, slot, slices, scratch)

    calls = len(layers)
    t_base, t_old, t_new = (
        time_graph_us(f, calls, replays=10) * calls for f in (base, two_launches, fused)
    )
    step = 4018.0  # us: the W2 decode step without LoRA (docs/performance.md, session 10)
    print(
        f"chain of {num_layers} layers x 4 projections, batch 1: base {t_base / 1e3:.3f} ms;"
        f" old +{(t_old - t_base) / 1e3:.3f} ms (~{100 * step / (step + t_old - t_base):.1f}%"
        f" of a {step / 1e3:.2f} ms step); new +{(t_new - t_base) / 1e3:.3f} ms"
        f" (~{100 * step / (step + t_new - t_base):.1f}%)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--projections", nargs="*", default=list(PROJECTIONS))
    parser.add_argument(
        "--shrink-k", type=int, nargs="*", default=[], help="also time these shrink tiles"
    )
    parser.add_argument("--tiny", action="store_true", help="small shapes (a CPU smoke run)")
    parser.add_argument(
        "--chain-layers", type=int, default=32, help="layers of the batch-1 chain (0: none)"
    )
    args = parser.parse_args()
    if args.tiny:
        PROJECTIONS.update(
            qkv=(64, [32, 16, 16]), o=(64, [64]), gate_up=(64, [48, 48]), down=(96, [64])
        )
    if args.chain_layers:
        bench_chain(args.chain_layers, args.rank, args.adapters)
    for name in args.projections:
        bench_projection(name, args.rank, args.adapters, args.calls, args.shrink_k)


if __name__ == "__main__":
    main()
