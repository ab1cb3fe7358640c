"""The quantized-weight kernels of ``quantized_gpu`` timed per Llama-3-8B projection (GPU only).

Each timing replays a CUDA graph of ``_REPLAYS`` launches that rotate over copies of the
weight whose total exceeds the L2 several times, so every launch reads its weight from
memory; bandwidth counts the bytes each kernel must read (weights, scales, x).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

_L2_DEFEAT_BYTES = 512 * 2**20
_REPLAYS = 20


def projections(shape: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of pagedlm's fused projections and the LM head."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    head_dim = hidden // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * head_dim
    return {
        "qkv_proj": (qkv, hidden),
        "o_proj": (hidden, hidden),
        "gate_up_proj": (2 * inter, hidden),
        "down_proj": (hidden, inter),
        "lm_head": (shape["vocab_size"], hidden),
    }


def _graph_us(launches: list[Callable[[], Any]]) -> float:
    """Microseconds per launch of ``launches`` replayed from one CUDA graph."""
    import torch

    for launch in launches[:2]:
        launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * len(launches))


def _weights(n: int, k: int) -> dict[str, list[Any]]:
    """Copies (enough to defeat the L2) of a random weight as bf16, FP8 and Q4_0."""
    import torch

    from pagedlm.model_executor.quantization.fp8 import quantize_rows
    from pagedlm_cuda.kernels.gguf_gemv import pack_blocks

    copies = max(2, -(-_L2_DEFEAT_BYTES // (n * k // 2)))
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(2)]
    fp8 = [quantize_rows(w) for w in bf16]
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
    scales = torch.full((n, k // 32), 0.003, device="cuda")
    q4 = [pack_blocks(codes, scales, -8 * scales, torch.device("cuda")) for _ in range(copies)]
    bf16_copies = max(2, -(-_L2_DEFEAT_BYTES // (n * k * 2)))
    fp8_copies = max(2, -(-_L2_DEFEAT_BYTES // (n * k)))
    return {
        "bf16": [bf16[i % 2].clone() for i in range(bf16_copies)],
        "fp8": [tuple(t.clone() for t in fp8[i % 2]) for i in range(fp8_copies)],
        "q4_0": q4,
    }


def _kernel_calls(kind: str, x, weights, config=None) -> list[Callable[[], Any]]:
    from pagedlm_cuda.kernels.fp8_gemv import fp8_gemv
    from pagedlm_cuda.kernels.gemv import gemv
    from pagedlm_cuda.kernels.gguf_gemv import gguf_gemv
    from pagedlm_cuda.kernels.gguf_gemv_half import gguf_gemv_half
    from pagedlm_cuda.kernels.gguf_gemv_int8 import gguf_gemv_int8

    calls = []
    for i in range(_REPLAYS):
        weight = weights[i % len(weights)]
        if kind == "bf16":
            calls.append(lambda w=weight: gemv(x, w))
        elif kind == "fp8":
            calls.append(lambda w=weight: fp8_gemv(x, w[0], w[1], None, config))
        elif kind == "q4_0_int8":
            calls.append(lambda w=weight: gguf_gemv_int8(x, w, None, config))
        elif kind == "q4_0_half":
            calls.append(lambda w=weight: gguf_gemv_half(x, w, None, config))
        else:
            calls.append(lambda w=weight: gguf_gemv(x, w, None, config))
    return calls


def _bytes(kind: str, weight) -> int:
    if kind == "bf16":
        return weight.numel() * 2
    if kind == "fp8":
        return weight[0].numel() + weight[1].numel() * 4
    return weight.nbytes()


def projection_times(shape: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    """Per projection and kind: microseconds and achieved bandwidth at batch 1."""
    import torch

    results: dict[str, Any] = {}
    for name, (n, k) in projections(shape).items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        weights = _weights(n, k)
        row = {}
        weights["q4_0_int8"] = weights["q4_0"]  # the same blocks, x rounded to int8
        weights["q4_0_half"] = weights["q4_0"]  # and with float16 products (the default)
        for kind in ("bf16", "fp8", "q4_0_half", "q4_0", "q4_0_int8"):
            us = _graph_us(_kernel_calls(kind, x, weights[kind]))
            rate = _bytes(kind, weights[kind][0]) / (us * 1e-6)
            row[kind] = {"us": us, "bytes_per_s": rate, "of_peak": rate / bandwidth}
        results[name] = row
        print(f"{name:13s} [{n}x{k}] " + "  ".join(
            f"{kind} {v['us']:7.1f} us {v['bytes_per_s'] / 1e12:4.2f} TB/s ({100 * v['of_peak']:.0f}%)"
            for kind, v in row.items()
        ), flush=True)  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    return results


SWEEP = list(itertools.product((16, 32), (256, 512, 1024, 2048), (4, 8), (3, 4)))


def gemv_sweep(shape: dict[str, Any]) -> dict[str, Any]:
    """Per projection and kind (fp8, q4_0): microseconds of every config in ``SWEEP``."""
    import torch

    results: dict[str, Any] = {}
    for name, (n, k) in projections(shape).items():
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        weights = _weights(n, k)
        for kind in ("fp8", "q4_0"):
            times = {str(c): _graph_us(_kernel_calls(kind, x, weights[kind], c)) for c in SWEEP}
            best = min(times, key=times.get)
            results[f"{name}/{kind}"] = {"best": best, "us": times}
            print(f"sweep {name} {kind}: best {best} {times[best]:.1f} us", flush=True)
        del weights
        torch.cuda.empty_cache()
    return results


def gemm_sweep(shape: dict[str, Any]) -> dict[str, Any]:
    """GGUF layer options by row count: tiled GEMM, dequantize + cuBLAS, bf16 cuBLAS."""
    import torch
    import torch.nn.functional as F

    from pagedlm_cuda.kernels.gguf_gemm import gguf_gemm

    results: dict[str, Any] = {}
    for name in ("o_proj", "gate_up_proj"):
        n, k = projections(shape)[name]
        weights = _weights(n, k)
        scratch = torch.empty(n * k, device="cuda", dtype=torch.bfloat16)
        for rows in (2, 4, 8, 16, 32, 64, 128, 256, 512):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            q4, bf16 = weights["q4_0"], weights["bf16"]
            picks = range(_REPLAYS)
            tiled = [partial(gguf_gemm, x, q4[i % len(q4)]) for i in picks]
            dense = [partial(_dequantized_linear, x, q4[i % len(q4)], scratch) for i in picks]
            cublas = [partial(F.linear, x, bf16[i % len(bf16)]) for i in picks]
            row = {"tiled": _graph_us(tiled), "dequantize_cublas": _graph_us(dense),
                   "bf16_cublas": _graph_us(cublas)}  # fmt: skip
            results[f"{name}/{rows}"] = row
            print(f"gemm {name} rows {rows:3d}: " + ", ".join(
                f"{key} {us:.1f} us" for key, us in row.items()), flush=True)  # fmt: skip
        del weights, scratch
        torch.cuda.empty_cache()
    return results


def _dequantized_linear(x, weight, scratch):
    import torch.nn.functional as F

    from pagedlm_cuda.kernels.gguf_gemm import dequantize_into

    return F.linear(x, dequantize_into(weight, scratch))
