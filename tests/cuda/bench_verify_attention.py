"""Verification attention speed on the GPU (not a test; run it by hand).

    python tests/cuda/bench_verify_attention.py [--query-len 5]

Times llama-3-8b's attention shape (32 heads, 8 kv heads, head_dim 128, bf16, block 16)
for a speculative verification step (``--query-len`` tokens per request over a ~1,100
token context) through ``paged_verify_attention`` (default split and nearby ones) and
through ``paged_prefill_attention``, which served these steps before, next to a plain
decode step of the same batch; 32 calls (one per layer) replayed from a CUDA graph sized
by max_model_len, as the engine's graphs are. Prints us per call.
"""

from __future__ import annotations

import argparse

import torch

from pagedlm_cuda.kernels import (
    paged_decode_attention,
    paged_prefill_attention,
    paged_verify_attention,
    write_kv_cache,
)
from pagedlm_cuda.kernels.verify_attention import verify_config

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, MAX_MODEL_LEN = 32, 8, 128, 16, 32, 4096


def graph_time(step) -> float:
    """Microseconds per call, median of 5 replays of a graph of ``LAYERS`` calls."""

    def layers() -> None:
        for _ in range(LAYERS):
            step()

    layers()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / LAYERS)
    return sorted(times)[2]


def bench(batch: int, context: int, query_len: int) -> None:
    seq_len = context + query_len
    blocks_per_seq = -(-seq_len // BLOCK)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, KV_HEADS, BLOCK, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), seq_len, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, batch * query_len + 1, query_len, dtype=torch.int32, device="cuda")
    query = torch.randn(batch * query_len, HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(query)
    decode_query = query[:batch].clone()
    decode_out = torch.empty_like(decode_query)
    scale = HEAD_DIM**-0.5
    rows = {
        "decode (1 token)": lambda: paged_decode_attention(
            decode_query, key_cache, value_cache, tables, lens, scale, MAX_MODEL_LEN, decode_out
        ),
        "prefill kernel": lambda: paged_prefill_attention(
            query, key_cache, value_cache, tables, lens, starts, scale, query_len, out
        ),
        "verify kernel": lambda: paged_verify_attention(
            query,
            key_cache,
            value_cache,
            tables,
            lens,
            starts,
            scale,
            query_len,
            MAX_MODEL_LEN,
            out,
        ),
    }
    key = torch.randn(batch * query_len, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    value = torch.randn_like(key)
    block = tables.long().repeat_interleave(BLOCK, dim=1)[:, context:seq_len]
    offset = torch.arange(context, seq_len, device="cuda") % BLOCK
    slots = (block * BLOCK + offset).view(-1).to(torch.int32)

    def write_then_verify() -> None:
        write_kv_cache(key, value, key_cache, value_cache, slots)
        paged_verify_attention(
            query,
            key_cache,
            value_cache,
            tables,
            lens,
            starts,
            scale,
            query_len,
            MAX_MODEL_LEN,
            out,
        )

    rows["KV write + verify"] = write_then_verify
    rows["verify writing the KV"] = lambda: paged_verify_attention(
        query, key_cache, value_cache, tables, lens, starts, scale, query_len, MAX_MODEL_LEN, out,
        new_kv=(key, value, slots),
    )  # fmt: skip
    default = verify_config(batch, KV_HEADS, HEAD_DIM)
    for partition in (32, 64, 128, 256):
        if partition == default.partition:
            continue
        config = default._replace(partition=partition, block_n=min(64, partition))
        rows[f"verify, partition {partition}"] = lambda c=config: paged_verify_attention(
            query, key_cache, value_cache, tables, lens, starts, scale, query_len,
            MAX_MODEL_LEN, out, config=c,
        )  # fmt: skip
    for warps in (8,):
        config = default._replace(num_warps=warps)
        rows[f"verify, {warps} warps"] = lambda c=config: paged_verify_attention(
            query, key_cache, value_cache, tables, lens, starts, scale, query_len,
            MAX_MODEL_LEN, out, config=c,
        )  # fmt: skip
    print(f"batch {batch}, {query_len} tokens per request over {context}: default {default}")
    for label, step in rows.items():
        print(f"  {label:28s} {graph_time(step):8.1f} us/call")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--query-len", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--context", type=int, default=1100)
    args = parser.parse_args()
    for batch in args.batches:
        bench(batch, args.context, args.query_len)


if __name__ == "__main__":
    main()
