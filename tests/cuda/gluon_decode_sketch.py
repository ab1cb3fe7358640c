"""A decode-attention partition written in Gluon (Triton's explicit-layout dialect), by
float32 multiply-adds: a candidate for the FP8 cache at large batches (not a test, not
used by the engine; run it by hand).

    PYTHONPATH=src:tests/cuda python tests/cuda/gluon_decode_sketch.py --sass       # no GPU
    PYTHONPATH=src:tests/cuda python tests/cuda/gluon_decode_sketch.py [--kv-cache-dtype fp8]

Why (docs/performance.md, session 29): the engine's decode kernel pads Qwen3-0.6B's group
of 2 query heads to the 16 rows of a tensor-core dot, its four warps split each tile's
keys, and an FP8 tile's loop spends 11 barriers and several shared-memory round trips per
64 keys; at W1's shape its time does not follow its bytes. Plain Triton chose layouts
that reduce across threads for every multiply-add formulation tried (12-44 instructions
per K/V element). Here the layout is fixed by hand: one warp per (sequence, kv head,
partition); each thread holds every query head of the group, ``NQ`` keys and 16
contiguous head dims, and the warp's 32 threads are 4 key groups x 8 dim chunks. Scores
reduce their 16 dims in the thread and the rest over 8 threads (3 shuffles); the
running max over a tile's keys crosses 4 threads; P @ V sums each thread's own keys in
the thread, and the 4 key groups meet once per partition. No barrier, no shared memory.

``--sass``: compiles for sm_90 (no GPU needed) and counts the key loop's instructions
per K/V element. Session 29: FP8 5.73 per element at NQ = 4 (168 registers), against the
dot kernel's 4.63 with 11 barriers per tile; bf16 6.1. ``--prefetch 1`` (loads one tile
ahead) costs FP8 byte permutes of the carried codes (8.5 per element, 157-255 registers)
and bf16 little (6.75 at NQ = 2, 128 registers). Gluon kernels do not run under
``TRITON_INTERPRET``, so nothing here runs without a GPU but ``--sass``.

Default: on a GPU, checks the partitions merged by the engine's merge kernel against a
float32 reference, and times them (one program per partition of ``--partition`` keys,
28 calls from a CUDA graph) against ``paged_decode_attention`` at W1's shape (batch 256
at 580 keys, qwen3-0.6b's heads). Session 30, H100: correct (max abs error 0.001); FP8
128.7 us per call at NQ = 2 without prefetch against the engine's 143.5, bf16 212.9
against 218.8. The same layout in plain Triton (session 30's ``decode_fma``, 4-d tiles)
timed alike at this uniform shape but lost W1, whose contexts run from 200 to 2,048 keys:
docs/performance.md, session 30. Not covered: the step's new K/V (the engine's kernel
writes them), sliding windows, soft-caps, programs that loop over partitions.
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

LOG2E = 1.4426950408889634
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 16, 8, 128, 16, 28
DS, NG = 16, 4
"""Contiguous head dims per thread, and key groups per warp (32 threads = NG x DC)."""


@gluon.jit
def _dim4(n: gl.constexpr, axis: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along ``axis`` of a rank-4 ``layout``, expanded to rank 4."""
    if axis == 0:
        i = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 1), 2), 3)
    elif axis == 1:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 2), 3)
    elif axis == 2:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 1), 3)
    else:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 1), 2)


@gluon.jit
def _dim3(n: gl.constexpr, axis: gl.constexpr, layout: gl.constexpr):
    """``arange(n)`` along ``axis`` of a rank-3 ``layout``, expanded to rank 3."""
    if axis == 0:
        i = gl.arange(0, n, layout=gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(i, 1), 2)
    elif axis == 1:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(2, layout)))
        return gl.expand_dims(gl.expand_dims(i, 0), 2)
    else:
        i = gl.arange(0, n, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
        return gl.expand_dims(gl.expand_dims(i, 0), 1)


@gluon.jit
def _load_tile(
    k_ptr, v_ptr, table, head_base, n0, end, key_index, dims, stride_block, stride_slot,
    BLOCK_SIZE: gl.constexpr,
):  # fmt: skip
    """Keys and values ``n0 ..`` of a tile as stored (zeros at or past ``end``)."""
    pos = n0 + key_index
    visible = pos < end
    block = gl.load(table + pos // BLOCK_SIZE, mask=visible, other=0).to(gl.int64)
    offsets = block * stride_block + head_base + (pos % BLOCK_SIZE) * stride_slot + dims
    tile_mask = visible & (dims >= 0)
    k = gl.load(k_ptr + offsets, mask=tile_mask, other=0.0)
    v = gl.load(v_ptr + offsets, mask=tile_mask, other=0.0)
    return k, v


@gluon.jit
def _partition_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, partial_out_ptr, partial_lse_ptr,
    stride_block, stride_head, stride_slot, table_stride, score_scale, v_scale,
    G: gl.constexpr, NQ: gl.constexpr, NG: gl.constexpr, DC: gl.constexpr, DS: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, PARTITION: gl.constexpr, NUM_HEADS: gl.constexpr,
    PREFETCH: gl.constexpr,
):  # fmt: skip
    """One partition of one (sequence, kv head): its output over its keys and their
    log2-sum-exp, in the layout ``_decode_merge_kernel`` reads. ``score_scale``: the
    softmax scale times log2(e) (times the key scale for FP8); ``v_scale``: 1, or the
    value scale. One warp. ``PREFETCH``: each tile's loads are issued before the tile
    ahead of it is computed (more registers, the loads' latency behind the arithmetic)."""
    # [G, NQ, NG, DC, DS]: a thread holds the group's heads, NQ keys and DS dims.
    P5: gl.constexpr = gl.BlockedLayout(
        [G, NQ, 1, 1, DS], [1, 1, NG, DC, 1], [1, 1, 1, 1, 1], [4, 3, 2, 1, 0]
    )
    LK: gl.constexpr = gl.SliceLayout(0, P5)  # a K/V tile: [NQ, NG, DC, DS]
    LA: gl.constexpr = gl.SliceLayout(1, P5)  # the query and the output: [G, NG, DC, DS]
    LS: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, P5))  # scores: [G, NQ, NG]
    LG: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LS))  # per head: [G]
    LO: gl.constexpr = gl.SliceLayout(1, LA)  # the partition's output: [G, DC, DS]
    BLOCK_N: gl.constexpr = NQ * NG
    seq = gl.program_id(0).to(gl.int64)
    kv_head = gl.program_id(1)
    part = gl.program_id(2)
    seq_len = gl.load(lens_ptr + seq)
    start = part * PARTITION
    end = gl.minimum(start + PARTITION, seq_len)
    if start < end:
        key_index = _dim4(NQ, 0, LK) * NG + _dim4(NG, 1, LK)  # [NQ, NG, 1, 1]
        dims = _dim4(DC, 2, LK) * DS + _dim4(DS, 3, LK)  # [1, 1, DC, DS]
        q_dims = _dim4(DC, 2, LA) * DS + _dim4(DS, 3, LA)
        q_heads = kv_head * G + _dim4(G, 0, LA)
        q = gl.load(q_ptr + (seq * NUM_HEADS + q_heads) * (DC * DS) + q_dims)
        q = gl.expand_dims(q.to(gl.float32), 1)  # [G, 1, 1, DC, DS]
        key_s = _dim3(NQ, 1, LS) * NG + _dim3(NG, 2, LS)  # [1, NQ, NG]
        table = table_ptr + seq * table_stride
        head_base = kv_head.to(gl.int64) * stride_head
        m = gl.full([G], float("-inf"), gl.float32, layout=LG)
        denom = gl.zeros([G], gl.float32, layout=LG)
        acc = gl.zeros([G, NG, DC, DS], gl.float32, layout=LA)
        if PREFETCH:
            k_raw, v_raw = _load_tile(
                k_ptr, v_ptr, table, head_base, start, end, key_index, dims, stride_block,
                stride_slot, BLOCK_SIZE,
            )  # fmt: skip
        for n0 in range(start, end, BLOCK_N):
            if PREFETCH:
                k_next, v_next = _load_tile(
                    k_ptr, v_ptr, table, head_base, n0 + BLOCK_N, end, key_index, dims,
                    stride_block, stride_slot, BLOCK_SIZE,
                )  # fmt: skip
            else:
                k_raw, v_raw = _load_tile(
                    k_ptr, v_ptr, table, head_base, n0, end, key_index, dims, stride_block,
                    stride_slot, BLOCK_SIZE,
                )  # fmt: skip
            k = k_raw.to(gl.float32)
            v = v_raw.to(gl.float32)
            s = gl.sum(gl.sum(q * gl.expand_dims(k, 0), axis=4), axis=3) * score_scale
            s = gl.where(n0 + key_s < end, s, float("-inf"))
            m_new = gl.maximum(m, gl.max(gl.max(s, axis=2), axis=1))
            p = gl.exp2(s - gl.expand_dims(gl.expand_dims(m_new, 1), 2))
            alpha = gl.exp2(m - m_new)
            denom = denom * alpha + gl.sum(gl.sum(p, axis=2), axis=1)
            pv = gl.sum(gl.expand_dims(gl.expand_dims(p, 3), 4) * gl.expand_dims(v, 0), axis=1)
            a = gl.convert_layout(
                alpha, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, LA)))
            )
            acc = acc * gl.expand_dims(gl.expand_dims(gl.expand_dims(a, 1), 2), 3) + pv
            m = m_new
            if PREFETCH:
                k_raw, v_raw = k_next, v_next
        d = gl.convert_layout(denom, gl.SliceLayout(1, gl.SliceLayout(2, LO)))
        out = gl.sum(acc, axis=1) * v_scale / gl.expand_dims(gl.expand_dims(d, 1), 2)
        heads = kv_head * G + _dim3(G, 0, LO)
        row = (seq * NUM_HEADS + heads) * gl.num_programs(2) + part
        gl.store(partial_out_ptr + row * (DC * DS) + _dim3(DC, 1, LO) * DS + _dim3(DS, 2, LO), out)
        lse_heads = kv_head * G + gl.arange(0, G, layout=LG)
        lse_row = (seq * NUM_HEADS + lse_heads) * gl.num_programs(2) + part
        gl.store(partial_lse_ptr + lse_row, m + gl.log2(denom))


def sass(fp8: bool, nq: int, prefetch: bool) -> str:
    """The key loop's instructions per K/V element, registers and commonest opcodes."""
    from sass_gguf_gemv import disassemble, main_loop
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    group = HEADS // KV_HEADS
    constants = dict(G=group, NQ=nq, NG=NG, DC=HEAD_DIM // DS, DS=DS, BLOCK_SIZE=BLOCK,
                     PARTITION=1024, NUM_HEADS=HEADS, PREFETCH=prefetch)  # fmt: skip
    kinds = {"k_ptr": "*fp8e4nv" if fp8 else "*bf16", "v_ptr": "*fp8e4nv" if fp8 else "*bf16",
             "table_ptr": "*i32", "lens_ptr": "*i32", "partial_out_ptr": "*fp32",
             "partial_lse_ptr": "*fp32", "q_ptr": "*bf16"}  # fmt: skip
    signature, attrs = {}, {}
    for index, name in enumerate(_partition_kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = kinds[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in ("score_scale", "v_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name != "table_stride":
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(_partition_kernel, signature, constants, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    code, usage = disassemble(kernel)
    registers = re.search(r"REG:(\d+)", usage)
    loop = main_loop(code, holding="FFMA")
    per_element = len(loop) / (2 * nq * NG * HEAD_DIM / 32)
    opcodes = collections.Counter(opcode.split(".")[0] for _, opcode, _ in loop)
    barriers = opcodes.get("BAR", 0)
    top = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(8))
    return (f"{'fp8' if fp8 else 'bf16'} NQ={nq} prefetch={int(prefetch)}: "
            f"{per_element:.2f} instructions per K/V "
            f"element, {registers[1] if registers else '?'} registers, {barriers} barriers | "
            f"{top}")  # fmt: skip


def run_partitions(
    inputs: dict, nq: int, prefetch: bool, partition: int, max_len: int, out: torch.Tensor
) -> torch.Tensor:
    """The sketch's partitions, then the engine's merge kernel: the attention output."""
    from pagedlm_cuda.kernels import pdl
    from pagedlm_cuda.kernels.decode_attention import MERGE_TILE, _decode_merge_kernel

    query, key_cache, value_cache = inputs["query"], inputs["key_cache"], inputs["value_cache"]
    tables, lens = inputs["tables"], inputs["lens"]
    num_seqs, num_heads, head_dim = query.shape
    group = num_heads // KV_HEADS
    parts = triton.cdiv(max_len, partition)
    partial_out = torch.empty(num_seqs, num_heads, parts, head_dim, device="cuda")
    partial_lse = torch.empty(num_seqs, num_heads, parts, device="cuda")
    k_scale, v_scale = inputs["scales"]
    _partition_kernel[(num_seqs, KV_HEADS, parts)](
        query, key_cache, value_cache, tables, lens, partial_out, partial_lse,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), tables.stride(0),
        inputs["scale"] * LOG2E * k_scale, v_scale,
        G=group, NQ=nq, NG=NG, DC=head_dim // DS, DS=DS, BLOCK_SIZE=BLOCK,
        PARTITION=partition, NUM_HEADS=num_heads, PREFETCH=prefetch, num_warps=1,
    )  # fmt: skip
    merge_g = triton.next_power_of_2(group)
    merge_p = max(1, min(MERGE_TILE // (merge_g * head_dim), 2048 // partition))
    _decode_merge_kernel[(num_seqs, KV_HEADS)](
        out, partial_out, partial_lse, lens, out.stride(0), out.stride(1), parts,
        num_heads, group, head_dim, 0, PARTITION=partition, MERGE_G=merge_g,
        MERGE_P=merge_p, BLOCK_D=head_dim, USE_WINDOW=False, **pdl.launch_options(),
    )  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true", help="count the loop (no GPU)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    parser.add_argument("--nq", type=int, nargs="+", default=[2, 4, 8], help="keys per thread")
    parser.add_argument(
        "--prefetch", type=int, nargs="+", default=[0, 1], help="0: load each tile in its "
        "iteration; 1: one tile ahead (the kernel's PREFETCH)",
    )  # fmt: skip
    parser.add_argument(
        "--partition", type=int, nargs="+", default=[1024, 512], help="keys per program"
    )  # fmt: skip
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=580)
    args = parser.parse_args()
    fp8 = args.kv_cache_dtype == "fp8"
    variants = [(nq, bool(prefetch)) for nq in args.nq for prefetch in args.prefetch]
    if args.sass:
        for nq, prefetch in variants:
            print(sass(fp8, nq, prefetch), flush=True)
        return
    from bench_decode_attention import make_inputs, reference_output
    from bench_timing import graph_us

    from pagedlm_cuda.kernels import paged_decode_attention

    inputs = make_inputs(args.batch, args.context, fp8, HEADS)
    scales = inputs["scales"]
    inputs["scale"] = 0.088  # bench_decode_attention's SCALE
    inputs["scales"] = (1.0, 1.0)  # its FP8 caches are stored at scale 1
    expected = reference_output(inputs)
    query, out = inputs["query"], torch.empty_like(inputs["query"])
    max_len = 4096
    caches = inputs["key_cache"], inputs["value_cache"], inputs["tables"], inputs["lens"]
    engine_us, _ = graph_us(
        [lambda: paged_decode_attention(query, *caches, inputs["scale"], max_len, out, **scales)]
        * LAYERS
    )
    print(f"engine kernel + merge: {engine_us:.1f} us per call")
    for partition in args.partition:
        for nq, prefetch in variants:
            got = run_partitions(inputs, nq, prefetch, partition, max_len, torch.empty_like(query))
            error = (got.float() - expected).abs().max().item()
            call = lambda: run_partitions(inputs, nq, prefetch, partition, max_len, out)  # noqa: B023, E731
            us, _ = graph_us([call] * LAYERS)
            print(
                f"gluon partition {partition} NQ={nq} prefetch={int(prefetch)}: {us:.1f} us "
                f"per call, max abs error {error:.4f}", flush=True,
            )  # fmt: skip


if __name__ == "__main__":
    main()
