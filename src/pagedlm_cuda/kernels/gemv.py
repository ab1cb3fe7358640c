"""``y = x W^T + b`` for one row of ``x``: the decode step of a single sequence.

At batch 1 every linear layer is a matrix-vector product that only streams its weight, so
its speed is the memory bandwidth it reaches. cuBLAS picks split-K GEMM tiles for these
shapes and stays near 3.1 TB/s on the smaller ones (llama-3-8b's q/k/v and o projections,
plus a separate split-K reduction kernel); this kernel gives each program ``BLOCK_N``
whole rows of ``W``, streams them in ``BLOCK_K`` slices and reduces in registers, with
no second pass. Measured on the H200 (bf16, weights rotated to
defeat the L2, from a CUDA graph): q/k/v 4096x6144 14.2 us against cuBLAS's 16.0, o
4096x4096 10.1 against 12.7, gate/up 4096x28672 54.3 against 55.0 (4.3 TB/s), down
14336x4096 28.8 against 30.5, LM head 4096x128256 231 against 239. In the llama-3-8b
decode step (W2) the linear layers went from 3.97 to 3.76 ms per token.

Accumulation is float32 in a fixed order that depends only on the shapes, so a row's
result does not depend on anything else in the step.

Two more tilings, off by default and NOT YET MEASURED ON A GPU (session 13 had no device
time left), aimed at the small projections (issue 12, W2: q/k/v at 73% and o at 78% of
4.8 TB/s, against 90-95% for gate/up, down and the LM head):

- ``pipeline_stages`` > 1: the slice loop becomes ``tl.range(..., num_stages=S)``, which
  copies S slices ahead into shared memory (``cp.async``). The kernel-level ``num_stages``
  that session 9 swept (3-6) pipelines only loads that feed a ``tl.dot``, so it never
  changed this kernel: each program has kept one slice in flight and waited out a full
  memory latency per slice. ptxas (sm_90a, offline) gives q/k/v's default tile 16x512 x 8
  warps 76 registers (3 programs per SM: 384 programs in one wave, 8 slices each) and o's
  16x1024 x 8 warps 128 (2 per SM: 256 programs, 4 slices each) -- one wave each, so the
  loss is latency per slice, not a tail. Pipelined: 16x512 x 8 warps, 3 stages, 80
  registers and 34 KB shared; 16x1024 x 8, 3 stages, 128 and 68 KB.
- ``split_k`` > 1: each row block's columns are cut into runs of whole slices, one program
  each; each run stores its float32 partials, takes a ticket (an int32 per row block in a
  per-device workspace, ``split_workspace``), and the holder of the last ticket sums the
  runs in run order, adds the bias, stores the row and resets the ticket. The result
  depends on the shapes only (not on which program finishes last), as batch-invariant
  mode needs; it differs in rounding from the unsplit kernel's, and the fused LoRA GEMV
  (``lora_fused.py``) reproduces only the unsplit bits.

What decides the defaults (H200, ``PYTHONPATH=src:tests``):

    python tests/cuda/bench_gemv.py --sweep --best-json best.json
    PAGEDLM_GEMV_CONFIGS=best.json python -m pagedlm.benchmarks.latency --model \
        llama-3-8b --batch-size 1 --input-len 1024 --output-len 256
    python -m pagedlm.benchmarks.latency --model llama-3-8b --batch-size 1 \
        --input-len 1024 --output-len 256

Prediction: the pipelined 2-3 stage tiles bring q/k/v and o to ~88-90% (q/k/v ~11.8 us,
o ~7.8), ~0.1 ms per W2 token (253.5 -> ~259 tok/s); split-K helps less, since neither
shape has a tail to cut, and adds a reduction; the large shapes change little.
"""

from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pagedlm_cuda.kernels import pdl


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, partial_ptr, tickets_ptr, N, K, stride_w,
    k_per_split, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PIPELINE: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.allow_next(USE_PDL)
    # The SPLIT_K programs of a row block are neighbours in launch order, so they run at
    # the same time and the last one finds the others' partials still in the L2.
    block = tl.program_id(0) // SPLIT_K
    split = tl.program_id(0) % SPLIT_K
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_w
    if SPLIT_K == 1:  # the unsplit kernel's code exactly (registers are occupancy here)
        k_start = 0
        k_end = K
    else:
        k_start = split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
    cols = k_start + tl.arange(0, BLOCK_K)
    # The first weight slice is read before waiting for the kernel that produces x:
    # weights never change, so this overlaps the previous kernel's tail.
    k_mask = cols < k_end
    w = tl.load(w_rows + cols[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    if HAS_SCALE:  # quantized rows (FP8): w[r] stands for w[r] * scale[r]
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    pdl.wait_for_previous(USE_PDL)
    x = tl.load(x_ptr + cols, mask=k_mask, other=0.0)
    acc = w.to(tl.float32) * x.to(tl.float32)[None, :]
    # PIPELINE > 1 keeps that many slices in flight (copied asynchronously to shared
    # memory); a plain loop issues a slice's loads only once the previous one is summed.
    for k0 in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=PIPELINE):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < k_end
        w = tl.load(w_rows + k[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_SCALE:
        y *= scale
    if SPLIT_K == 1:
        _store_rows(y, rows, row_mask, bias_ptr, out_ptr, HAS_BIAS)
    else:
        tl.store(partial_ptr + split * N + rows, y, mask=row_mask)
        # Stores land before the ticket (release); the holder of the last ticket sees them
        # all (acquire), sums the splits in their order and resets the counter.
        tl.debug_barrier()
        ticket = tl.atomic_add(tickets_ptr + block, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            tl.store(tickets_ptr + block, 0)
            y = tl.load(partial_ptr + rows, mask=row_mask, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT_K):
                y += tl.load(
                    partial_ptr + s * N + rows, mask=row_mask, other=0.0, cache_modifier=".cg"
                )
            _store_rows(y, rows, row_mask, bias_ptr, out_ptr, HAS_BIAS)


@triton.jit
def _store_rows(y, rows, row_mask, bias_ptr, out_ptr, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_mask)


class GemvConfig(NamedTuple):
    """How ``gemv`` tiles a weight: each program owns ``block_n`` rows and a run of their
    columns, which it streams in ``block_k``-column slices. ``split_k`` > 1 cuts each row
    block's columns into that many runs of whole slices, one program each; the last to
    finish sums the runs' float32 partials in run order. ``pipeline_stages`` > 1 keeps that
    many slices in flight through shared memory (1: a plain loop)."""

    block_n: int
    block_k: int
    num_warps: int
    pipeline_stages: int = 1
    split_k: int = 1


CONFIGS_ENV = "PAGEDLM_GEMV_CONFIGS"
"""For measuring only (off unless set): a JSON file ``{"N,K": [block_n, block_k,
num_warps, pipeline_stages, split_k]}`` (what ``tests/cuda/bench_gemv.py --best-json``
writes) whose entries replace ``gemv_config``'s for those weight shapes."""


@functools.cache
def _configs_from_env() -> dict[tuple[int, int], GemvConfig]:
    path = os.environ.get(CONFIGS_ENV)
    if not path:
        return {}
    with open(path) as f:
        table = json.load(f)
    configs = {}
    for key, tiles in table.items():
        shape = tuple(int(v) for v in key.split(","))
        if len(shape) != 2 or not 3 <= len(tiles) <= 5 or not all(t >= 1 for t in tiles):
            raise ValueError(
                f'{CONFIGS_ENV}={path}: entry {key!r}: {tiles!r}; write "N,K": [block_n, '
                "block_k, num_warps, pipeline_stages, split_k] (positive integers, the last "
                "two optional)."
            )
        configs[shape] = GemvConfig(*tiles)
    return configs


def gemv_config(n: int, k: int) -> GemvConfig:
    """From H200 sweeps of 4-32 rows x 128-1024 columns x 4/8 warps (bf16; session 9; its
    3-6 kernel-level stages did not pipeline this loop, see the module docstring):
    16 rows per program throughout; the fewer programs a layer has, the wider each one's
    slices (1024 columns up to 4k outputs, 512 up to 8k, 256 with 4 warps beyond, where
    many programs share each SM)."""
    chosen = _configs_from_env().get((n, k))
    if chosen is not None:
        return chosen
    if n <= 4096:
        return GemvConfig(16, 1024, 8)
    if n <= 8192:
        return GemvConfig(16, 512, 8)
    return GemvConfig(16, 256, 4)


_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def split_workspace(
    device: torch.device, partials: int, row_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partial sums, zeroed int32 tickets) of ``device``, at least ``partials``
    and ``row_blocks`` long. Every split call leaves the tickets at 0 again and writes the
    partials only after its PDL wait (when the call before it has completed), so one
    buffer serves every layer and step; calls on one device must not overlap (one stream
    per device, as the model runner has). It only grows, and never while a graph is
    captured (the CUDA-graph runner runs each batch size eagerly first)."""
    held = _workspaces.get(device)
    if held is not None and held[0].numel() >= partials and held[1].numel() >= row_blocks:
        return held
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "gemv's split-K workspace would grow inside CUDA-graph capture; run the "
            "same shapes once eagerly before capturing."
        )
    size = max(partials, 1 << 16, held[0].numel() if held else 0)
    count = max(row_blocks, 1 << 12, held[1].numel() if held else 0)
    held = (
        torch.empty(size, dtype=torch.float32, device=device),
        torch.zeros(count, dtype=torch.int32, device=device),
    )
    _workspaces[device] = held
    return held


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    config: GemvConfig | tuple[int, ...] | None = None,
) -> torch.Tensor:
    """x [1, K] (unit-stride row), weight [N, K] (unit-stride rows; any float dtype, FP8
    included, converted in registers), bias [N] or None, weight_scale float32 [N] (or
    [N, 1]) or None: row r's result times weight_scale[r] -> [1, N] in x's dtype."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv takes one row, x of shape [1, K]; got {tuple(x.shape)}.")
    n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x has {x.shape[1]} features but weight is [{n}, {k}].")
    if weight_scale is not None and weight_scale.numel() != n:
        raise ValueError(f"{weight_scale.numel()} weight scales for a weight of {n} rows.")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs unit-stride rows in x and weight.")
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    cfg = GemvConfig(*config) if config is not None else gemv_config(n, k)
    row_blocks = triton.cdiv(n, cfg.block_n)
    # Each run is whole slices; a split that would leave a run empty is not taken.
    slices_per_run = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k)
    k_per_split = slices_per_run * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    unused = weight_scale if weight_scale is not None else weight
    partials, tickets = unused, unused
    if split_k > 1:
        partials, tickets = split_workspace(x.device, split_k * n, row_blocks)
    _gemv_kernel[(row_blocks * split_k,)](
        x, weight, unused, bias if bias is not None else unused, out, partials, tickets, n,
        k, weight.stride(0), k_per_split, HAS_SCALE=weight_scale is not None,
        HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        SPLIT_K=split_k, PIPELINE=cfg.pipeline_stages, num_warps=cfg.num_warps,
        num_stages=cfg.pipeline_stages, **pdl.launch_options(),
    )  # fmt: skip
    return out
