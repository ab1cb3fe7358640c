"""Decode attention speed on the GPU, per configuration (not a test; run it by hand).

    python tests/cuda/bench_decode_attention.py [--kv-cache-dtype fp8] [--workloads W1]

Times ``paged_decode_attention`` for llama-3-8b's attention shape (32 heads, 8 kv heads,
head_dim 128, bf16, block 16) at the two workloads of docs/performance.md (W2: batch 1 at
~1,100 tokens; W1: batch 256 at ~580), replaying 32 calls (one per layer) from a CUDA graph
whose grid is sized by max_model_len, as the engine's decode graphs are. Prints us per
call and the K/V bandwidth reached, for the default (``decode_config``) and for nearby
partition / tile choices, so the table in ``kernels/decode_config.py`` can be checked.
``--kv-cache-dtype fp8``: the same for a float8 E4M3 cache (bandwidth counted in its bytes).
"""

from __future__ import annotations

import argparse

import torch

from pagedlm_cuda.kernels import paged_decode_attention
from pagedlm_cuda.kernels.decode_config import DecodeConfig, decode_config

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, MAX_MODEL_LEN = 32, 8, 128, 16, 32, 4096


def time_config(
    batch: int,
    context: int,
    partition: int | None,
    block_n: int | None,
    fp8: bool = False,
    config: DecodeConfig | None = None,
) -> float:
    """Microseconds per call, median of 5 replays of a 32-call graph."""
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
    query = torch.randn(batch, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(query)

    def step() -> None:
        for _ in range(LAYERS):
            paged_decode_attention(
                query, key_cache, value_cache, tables, lens, 0.088, MAX_MODEL_LEN, out,
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
    return sorted(times)[2]


WORKLOADS = {"W2": (1, 1100), "small": (4, 1100), "W1": (256, 580)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    args = parser.parse_args()
    fp8 = args.kv_cache_dtype == "fp8"
    for batch, context in (WORKLOADS[w] for w in args.workloads):
        default = decode_config(batch, KV_HEADS, HEAD_DIM, fp8)
        kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * (1 if fp8 else 2)
        print(f"batch {batch}, context {context}, {args.kv_cache_dtype} cache: default {default}")
        candidates = [(None, None)] + [
            (p, n) for p in (32, 64, 128, 256) for n in (32, 64) if n <= p
        ]  # fmt: skip
        for partition, block_n in candidates:
            us = time_config(batch, context, partition, block_n, fp8)
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
            us = time_config(batch, context, None, None, fp8, config)
            label = f"block_n {block_n}, {warps} warps, {stages} stages"
            print(f"  {label:28s} {us:8.1f} us/call  {kv_bytes / us / 1e6:6.2f} TB/s")


if __name__ == "__main__":
    main()
