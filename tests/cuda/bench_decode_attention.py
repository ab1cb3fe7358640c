"""Decode attention speed on the GPU, per configuration (not a test; run it by hand).

    python tests/cuda/bench_decode_attention.py [--kv-cache-dtype fp8] [--workloads W1]
        [--num-heads 16] [--sweep]

Times ``paged_decode_attention`` for llama-3-8b's attention shape (32 heads, 8 kv heads,
head_dim 128, bf16, block 16) at the two workloads of docs/performance.md (W2: batch 1 at
~1,100 tokens; W1: batch 256 at ~580), replaying 32 calls (one per layer) from a CUDA graph
whose grid is sized by max_model_len, as the engine's decode graphs are. Prints us per
call and the K/V bandwidth reached, for the default (``decode_config``) and for nearby
partition / tile choices, so the table in ``kernels/decode_config.py`` can be checked.
``--kv-cache-dtype fp8``: the same for a float8 E4M3 cache (bandwidth counted in its bytes).
``--num-heads 16``: qwen3-0.6b's heads (W1's model). ``--slots 0 2 4 8``: the default
configuration at each count of programs per (sequence, kv head) (0: one per partition of
the grid's length), with ``--ragged LOW HIGH`` contexts drawn uniformly between the two
(W1's run from 200 to 2,048 keys). ``--sweep``: partition / tile / warps / stages
choices (``SWEEP``, or ``--configs P,N,W,S[,R] ...``, R a register cap), each with its
error against a float32 reference of the (dequantized) cache (max abs, and relative: the
norm of the difference over the reference's); with ``--sweep``, ``--slots`` and
``--ragged`` apply to every choice (no error columns with ``--ragged``).
"""

from __future__ import annotations

import argparse

import torch

from pagedlm_cuda.kernels import paged_decode_attention
from pagedlm_cuda.kernels.decode_config import DecodeConfig, decode_config

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, MAX_MODEL_LEN = 32, 8, 128, 16, 32, 4096
SCALE = 0.088


def make_inputs(batch: int, context: int, fp8: bool, heads: int = HEADS) -> dict:
    """Random caches (E4M3 at scale 1 when ``fp8``), shuffled tables and a query."""
    torch.manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    scales = {}
    if fp8:
        key_cache, value_cache = (c.to(torch.float8_e4m3fn) for c in (key_cache, value_cache))
        one = torch.ones(1, dtype=torch.float32, device="cuda")
        scales = {"k_scale": one, "v_scale": one}
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    return dict(key_cache=key_cache, value_cache=value_cache, tables=tables, lens=lens,
                query=query, scales=scales, context=context)  # fmt: skip


def reference_output(inputs: dict) -> torch.Tensor:
    """float32 attention over the dequantized cache (every sequence has ``context`` keys)."""
    tables, context, query = inputs["tables"], inputs["context"], inputs["query"]
    batch, heads, _ = query.shape
    keys, values = (
        inputs[name][tables.long()]  # [batch, blocks, kv heads, block, dim]
        .float()
        .permute(0, 2, 1, 3, 4)
        .reshape(batch, KV_HEADS, -1, HEAD_DIM)[:, :, :context]
        for name in ("key_cache", "value_cache")
    )
    grouped = query.float().view(batch, KV_HEADS, heads // KV_HEADS, HEAD_DIM)
    weights = torch.softmax(grouped @ keys.transpose(-1, -2) * SCALE, dim=-1)
    return (weights @ values).view(batch, heads, HEAD_DIM)


def time_inputs(
    inputs: dict,
    partition: int | None = None,
    block_n: int | None = None,
    config: DecodeConfig | None = None,
    max_model_len: int = MAX_MODEL_LEN,
) -> tuple[float, torch.Tensor]:
    """(microseconds per call, median of 5 replays of a 32-call graph whose grid is sized
    by ``max_model_len``; the output)."""
    key_cache, value_cache = inputs["key_cache"], inputs["value_cache"]
    tables, lens, query, scales = (inputs[n] for n in ("tables", "lens", "query", "scales"))
    out = torch.empty_like(query)

    def step() -> None:
        for _ in range(LAYERS):
            paged_decode_attention(
                query, key_cache, value_cache, tables, lens, SCALE, max_model_len, out,
                partition, block_n, config=config, **scales,
            )  # fmt: skip

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / LAYERS)
    return sorted(times)[2], out


def time_config(
    batch: int,
    context: int,
    partition: int | None,
    block_n: int | None,
    fp8: bool = False,
    config: DecodeConfig | None = None,
    heads: int = HEADS,
) -> float:
    """Microseconds per call, median of 5 replays of a 32-call graph."""
    inputs = make_inputs(batch, context, fp8, heads)
    return time_inputs(inputs, partition, block_n, config)[0]


WORKLOADS = {"W2": (1, 1100), "small": (4, 1100), "W1": (256, 580)}

SWEEP = [  # (partition, block_n, warps, stages)
    (256, 64, 4, 2),
    (256, 64, 8, 2),
    (128, 64, 4, 2),
    (1024, 64, 4, 2),
    (512, 32, 4, 2),
    (512, 32, 4, 4),
    (512, 128, 4, 2),
    (512, 128, 4, 3),
    (512, 128, 8, 2),
    (512, 128, 8, 3),
    (512, 64, 4, 2),
    (512, 64, 4, 3),
    (512, 64, 4, 4),
    (512, 256, 4, 2),
    (512, 256, 8, 2),
    (256, 128, 4, 3),
    (256, 64, 4, 3),
    (1024, 128, 4, 3),
]


def ragged_lens(inputs: dict, low: int, high: int) -> None:
    """Contexts drawn uniformly in ``low .. high`` (``high`` the inputs' context)."""
    generator = torch.Generator().manual_seed(1)
    lens = torch.randint(low, high + 1, (len(inputs["lens"]),), generator=generator)
    inputs["lens"] = lens.to(device="cuda", dtype=torch.int32)


def sweep(
    batch: int, context: int, heads: int, fp8: bool, grid_lens: list[int],
    configs: list[tuple[int, ...]] = SWEEP, slots: list[int] | None = None,
    ragged: tuple[int, int] | None = None,
) -> None:  # fmt: skip
    """The configurations of ``configs`` (``SWEEP``: partition, block_n, warps, stages,
    and optionally a register cap) at one workload: time, rate and error; each also with
    the grid sized by the other ``grid_lens`` (its programs past a sequence's end exit at
    once, and what they cost shows as the difference)."""
    inputs = make_inputs(batch, ragged[1] if ragged else context, fp8, heads)
    if ragged:
        ragged_lens(inputs, *ragged)
    expected = None if ragged else reference_output(inputs)
    kv_bytes = 2 * int(inputs["lens"].sum()) * KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
    default = decode_config(batch, KV_HEADS, HEAD_DIM, fp8)
    kind = "fp8" if fp8 else "bf16"
    print(f"sweep: batch {batch}, context {ragged or context}, {heads} heads, {kind}; default "
          f"{default}")  # fmt: skip
    print("  partition block_n warps stages regs slots |     us  TB/s | max err  rel err")
    # The default first, so every sweep is read against it.
    mine = (default.partition, default.block_n, default.num_warps, default.num_stages)
    configs = [mine] + [c for c in configs if tuple(c[:4]) != mine or c[4:]]
    for (partition, block_n, warps, stages, *cap), count in (
        (c, n) for c in configs for n in (slots or [default.slots])
    ):  # fmt: skip
        config = default._replace(
            partition=partition, block_n=block_n, num_warps=warps, num_stages=stages,
            slots=count,
        )  # fmt: skip
        if cap:
            config = config._replace(max_registers=cap[0])
        label = (
            f"  {partition:9d} {block_n:7d} {warps:5d} {stages:6d} {config.max_registers:4d} "
            f"{count:5d}"
        )
        try:
            us, out = time_inputs(inputs, config=config, max_model_len=grid_lens[0])
            others = [time_inputs(inputs, config=config, max_model_len=n)[0] for n in grid_lens[1:]]
        except Exception as error:  # e.g. a tile past the shared memory
            print(f"{label} | failed: {type(error).__name__}: {str(error)[:100]}", flush=True)
            continue
        errors = "      -        -"
        if expected is not None:
            diff = (out.float() - expected).abs()
            rel = (diff.norm() / expected.norm()).item()
            errors = f"{diff.max().item():7.4f} {rel:8.2e}"
        rate = kv_bytes / us / 1e6
        grids = "".join(f" | grid {n}: {t:6.1f}" for n, t in zip(grid_lens[1:], others))
        print(f"{label} | {us:6.1f} {rate:5.2f} | {errors}{grids}", flush=True)


def time_slots(
    batch: int, context: int, heads: int, fp8: bool, slots: list[int], grid_lens: list[int],
    ragged: tuple[int, int] | None, max_registers: list[int],
) -> None:  # fmt: skip
    """The default configuration at each ``slots``, grid length and register cap (us per
    call)."""
    if ragged:
        context = ragged[1]
    inputs = make_inputs(batch, context, fp8, heads)
    if ragged:
        ragged_lens(inputs, *ragged)
    kv_bytes = 2 * int(inputs["lens"].sum()) * KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
    default = decode_config(batch, KV_HEADS, HEAD_DIM, fp8)
    print(f"batch {batch}, contexts {ragged or context}, fp8 {fp8}: default {default}")
    for grid_len in grid_lens:
        for count in slots:
            for cap in max_registers:
                config = default._replace(slots=count, max_registers=cap)
                us = time_inputs(inputs, config=config, max_model_len=grid_len)[0]
                print(
                    f"  grid {grid_len:6d}, slots {count:3d}, max registers {cap:3d}: "
                    f"{us:8.1f} us/call {kv_bytes / us / 1e6:6.2f} TB/s", flush=True,
                )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--num-heads", type=int, default=HEADS)
    parser.add_argument("--sweep", action="store_true", help="the sweep (see above)")
    parser.add_argument(
        "--configs", nargs="+", metavar="P,N,W,S[,R]",
        help="with --sweep: these configurations instead of SWEEP (partition, block_n, "
        "warps, stages, and a register cap: 0 for none; the default's cap where left out)",
    )  # fmt: skip
    parser.add_argument("--slots", type=int, nargs="+", help="programs per sequence (see above)")
    parser.add_argument("--ragged", type=int, nargs=2, metavar=("LOW", "HIGH"))
    parser.add_argument(
        "--max-registers", type=int, nargs="+", default=[0],
        help="with --slots: register caps per thread to time (0: the compiler's choice)",
    )  # fmt: skip
    parser.add_argument(
        "--grid-lens", type=int, nargs="+", default=[MAX_MODEL_LEN],
        help="the max_model_len sizing the grid; --sweep times each further one too",
    )  # fmt: skip
    args = parser.parse_args()
    heads = args.num_heads
    fp8 = args.kv_cache_dtype == "fp8"
    if args.sweep:
        configs = SWEEP
        if args.configs:
            configs = [tuple(int(x) for x in c.split(",")) for c in args.configs]
        for workload in args.workloads:
            sweep(
                *WORKLOADS[workload], heads, fp8, args.grid_lens, configs, args.slots,
                args.ragged,
            )  # fmt: skip
        return
    if args.slots:
        for workload in args.workloads:
            time_slots(
                *WORKLOADS[workload], heads, fp8, args.slots, args.grid_lens, args.ragged,
                args.max_registers,
            )  # fmt: skip
        return
    for batch, context in (WORKLOADS[w] for w in args.workloads):
        default = decode_config(batch, KV_HEADS, HEAD_DIM, fp8)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
        print(f"batch {batch}, context {context}, {args.kv_cache_dtype} cache: default {default}")
        candidates = [(None, None)] + [
            (p, n) for p in (32, 64, 128, 256) for n in (32, 64) if n <= p
        ]  # fmt: skip
        for partition, block_n in candidates:
            us = time_config(batch, context, partition, block_n, fp8, heads=heads)
            label = "default" if partition is None else f"partition {partition}, block_n {block_n}"
            print(f"  {label:28s} {us:8.1f} us/call  {kv_bytes / us / 1e6:6.2f} TB/s")
        for block_n, warps, stages in (
            (64, 4, 3),
            (64, 8, 2),
            (128, 4, 2),
            (128, 8, 2),
            (128, 8, 3),
        ):
            if block_n > default.partition:
                continue
            config = default._replace(block_n=block_n, num_warps=warps, num_stages=stages)
            us = time_config(batch, context, None, None, fp8, config, heads)
            label = f"block_n {block_n}, {warps} warps, {stages} stages"
            print(f"  {label:28s} {us:8.1f} us/call  {kv_bytes / us / 1e6:6.2f} TB/s")


if __name__ == "__main__":
    main()
