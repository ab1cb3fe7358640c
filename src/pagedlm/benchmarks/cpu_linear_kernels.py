"""The CPU candidates for a quantized linear layer, timed on a decoder's shapes by row count.

    python -m pagedlm.benchmarks.cpu_linear_kernels --rows 1 8 16 32 64 128 --threads 1

Every candidate computes ``x W^T`` for the weights one set of random GGUF-like blocks (4-bit
codes, a scale and a minimum per 32) stands for, over ``--layers`` distinct layers of each
of the model's projections (qkv, o, gate_up, down; SmolLM2-135M's shapes by default), so
the weights stream from memory as in a real step rather than from cache. Times are the CPU
time of the calling thread (``time.thread_time``): on a shared machine other processes'
time is not counted, though their cache and memory traffic is. Per candidate the table also
says the bytes its weights take and how long preparing them took (what loading pays), and
its relative error against float32 ``F.linear`` on the dequantized weights.

Candidates: torch's int4 kernel on the codes (what ``quantized_linear.Int4Linear`` runs),
oneDNN prepacked in float32 and bf16 on the dequantized weights, ``_weight_int8pack_mm``
(per-row int8), ``quantized.linear_dynamic`` (fbgemm/oneDNN int8 weights per output row,
activations quantized per tensor at run time), and dequantize-into-scratch + ``F.linear``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedlm.model_executor.loader.gguf_blocks import GROUP_SIZE, AffineBlocks

Kernel = Callable[[torch.Tensor], torch.Tensor]

SMOLLM2_SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
"""(out_features, in_features) of SmolLM2-135M's projections."""
SMOLLM2_LM_HEAD = (49152, 576)
"""Its LM head (the tied Q8_0 embedding table)."""


def random_blocks(rows: int, cols: int, seed: int, bits: int = 4) -> AffineBlocks:
    """Q4_1-like blocks (``bits`` 4) or Q8_0-like ones (8): codes 0..2^bits-1, scales about
    0.01 / 2^(bits-4), minimums about -2^(bits-1) scales."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(rows, cols // GROUP_SIZE, generator=generator) * 0.02 + 1e-3) / (
        1 << (bits - 4)
    )
    noise = torch.randn(rows, cols // GROUP_SIZE, generator=generator) * 1e-3
    return AffineBlocks(codes, scales, -(1 << (bits - 1)) * scales + noise)


def _int4(blocks: AffineBlocks) -> Kernel:
    from pagedlm_cpu.quantized_linear import DequantScratch, Int4Linear

    layer = Int4Linear(blocks, None, DequantScratch(), max_rows=1 << 30)
    return layer


def _onednn(dtype: torch.dtype) -> Callable[[AffineBlocks], Kernel]:
    def make(blocks: AffineBlocks) -> Kernel:
        packed = torch.ops.mkldnn._reorder_linear_weight(blocks.dequantize().to(dtype), 32)

        def run(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, None, "none", [], "")

        run.weights = (packed,)  # type: ignore[attr-defined]
        return run

    return make


def _plain_float32(blocks: AffineBlocks) -> Kernel:
    weight = blocks.dequantize()

    def run(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), weight)

    run.weights = (weight,)  # type: ignore[attr-defined]
    return run


def _int8pack(blocks: AffineBlocks) -> Kernel:
    weight = blocks.dequantize()
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
    codes = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    scales = scales.to(torch.bfloat16)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), codes, scales)

    run.weights = (codes, scales)  # type: ignore[attr-defined]
    return run


def _dynamic_int8(blocks: AffineBlocks) -> Kernel:
    weight = blocks.dequantize()
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
    zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
    qweight = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qweight, None)

    def run(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), packed, True)

    run.weights = (qweight,)  # type: ignore[attr-defined]
    return run


def _dequantize_then_linear(dtype: torch.dtype) -> Callable[[AffineBlocks], Kernel]:
    def make(blocks: AffineBlocks) -> Kernel:
        from pagedlm_cpu.quantized_linear import DequantScratch, Int4Linear

        layer = Int4Linear(blocks, None, DequantScratch(), max_rows=0)

        def run(x: torch.Tensor) -> torch.Tensor:
            return layer(x.to(dtype))

        run.weights = (blocks.codes, blocks.scales, blocks.mins)  # type: ignore[attr-defined]
        return run

    return make


CANDIDATES: dict[str, Callable[[AffineBlocks], Kernel]] = {
    "int4 (codes, bf16 activations)": _int4,
    "oneDNN float32 (dequantized)": _onednn(torch.float32),
    "oneDNN bf16 (dequantized)": _onednn(torch.bfloat16),
    "F.linear float32 (dequantized)": _plain_float32,
    "_weight_int8pack_mm (per-row int8)": _int8pack,
    "quantized.linear_dynamic (int8 x int8)": _dynamic_int8,
    "dequantize + F.linear float32": _dequantize_then_linear(torch.float32),
}


def _weight_bytes(kernel: Kernel) -> int:
    tensors = getattr(kernel, "weights", None)
    if tensors is None:  # Int4Linear
        tensors = (kernel.packed, kernel.scale_zeros)  # type: ignore[attr-defined]
    total = 0
    for tensor in tensors:
        if tensor.is_quantized or tensor.is_mkldnn:
            total += tensor.numel() * tensor.element_size()
        else:
            total += tensor.untyped_storage().nbytes()
    return total


@dataclass
class Result:
    name: str
    ms_by_rows: dict[int, float]
    weight_mb: float
    prepare_s: float
    relative_error: float


def measure(
    name: str,
    make: Callable[[AffineBlocks], Kernel],
    layers: list[AffineBlocks],
    rows: list[int],
    repeats: int,
) -> Result:
    start = time.thread_time()
    kernels = [make(blocks) for blocks in layers]
    prepare_s = time.thread_time() - start
    weight_mb = sum(map(_weight_bytes, kernels)) / 2**20
    generator = torch.Generator().manual_seed(1)
    probe = torch.randn(8, layers[0].codes.shape[1], generator=generator)
    expected = F.linear(probe, layers[0].dequantize())
    error = ((kernels[0](probe).float() - expected).norm() / expected.norm()).item()
    ms_by_rows = {}
    for n in rows:
        inputs = {
            blocks.codes.shape[1]: torch.randn(n, blocks.codes.shape[1], generator=generator)
            for blocks in layers
        }
        for kernel, blocks in zip(kernels, layers):  # warm-up (first-call allocations)
            kernel(inputs[blocks.codes.shape[1]])
        times = []
        for _ in range(repeats):
            start = time.thread_time()
            for kernel, blocks in zip(kernels, layers):
                kernel(inputs[blocks.codes.shape[1]])
            times.append(time.thread_time() - start)
        ms_by_rows[n] = statistics.median(times) * 1e3
    return Result(name, ms_by_rows, weight_mb, prepare_s, error)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=30, help="distinct layers per shape")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", nargs="*", default=None, help="candidates whose name has one")
    parser.add_argument(
        "--lm-head", action="store_true", help="time the LM head (Q8_0 codes) instead"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.lm_head:
        layers = [random_blocks(*SMOLLM2_LM_HEAD, seed=0, bits=8)]
        what = f"the LM head {SMOLLM2_LM_HEAD}, 8-bit codes"
    else:
        layers = [
            random_blocks(out, inp, seed=1000 * i + j)
            for i in range(args.layers)
            for j, (out, inp) in enumerate(SMOLLM2_SHAPES.values())
        ]
        what = f"{len(layers)} layers ({args.layers} x {'/'.join(SMOLLM2_SHAPES)}), 4-bit codes"
    print(
        f"{what}, {args.threads} thread(s), thread time, median of {args.repeats}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    header = " | ".join(f"{n} rows" for n in args.rows)
    print(f"| kernel | {header} | weights MB | prepare s | rel. error |")
    print("| --- " * (len(args.rows) + 4) + "|")
    for name, make in CANDIDATES.items():
        if args.only and not any(word in name for word in args.only):
            continue
        result = measure(name, make, layers, args.rows, args.repeats)
        cells = " | ".join(f"{result.ms_by_rows[n]:.1f}" for n in args.rows)
        print(
            f"| {name} | {cells} | {result.weight_mb:.0f} | {result.prepare_s:.2f} "
            f"| {result.relative_error:.1e} |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
