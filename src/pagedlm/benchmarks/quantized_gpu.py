"""``python -m pagedlm.benchmarks.quantized_gpu``: quantized weights on the GPU against bf16.

Parts (``--parts``, all by default), each comparison measured in this one process:

- ``fp8``: W2 (Llama-3-8B shape, random weights, batch 1, 1024 in / 256 out) in bf16,
  then with ``quantization="fp8"`` (target: >= 1.8x the bf16 tok/s);
- ``gguf``: an 8B-shaped Q4_0 GGUF written here with the ``gguf`` package (random blocks:
  a pool of random 18-byte blocks tiled over every tensor, so writing 4.5 GB takes seconds;
  norms F32 ones), run at batch 1 as W2 with its blocks kept on the GPU, against the bf16
  run of the ``fp8`` part or a bf16 run of its own (target: >= 2.8x the bf16 tok/s); once
  per batch-1 GEMV of ``--gguf-gemvs``: ``half`` (``gguf_gemv_half``, float16 products:
  the default), ``float`` (``gguf_gemv``'s exact float32 products:
  ``PAGEDLM_GGUF_EXACT_GEMV=1``) and ``int8`` (``gguf_gemv_int8``, x rounded to int8:
  ``PAGEDLM_GGUF_INT8_GEMV=1``), and
  with ``--gemv-configs FILE`` each once more with its tiles from FILE (the ``fp8``
  part's two runs too);
- ``kernels``: each Llama-3-8B projection at batch 1 through the bf16 GEMV, the FP8 GEMV
  and the three Q4_0 GEMVs (float16 products, exact, int8), weights rotated over copies
  that exceed the L2, from CUDA graphs: microseconds and achieved bandwidth against the
  H200's 4.8 TB/s (``--bandwidth``).

Optional sweeps for tuning: ``--gemv-sweep`` times every (BLOCK_N, BLOCK_K, warps, stages)
of a small grid for the FP8 and Q4_0 GEMVs per projection; ``--gemm-sweep`` times the GGUF
layers' options at 2..512 rows (tiled dequantizing GEMM, dequantize + cuBLAS, and bf16
cuBLAS) on the gate/up and o shapes, which places ``GgufCudaLinear.max_tiled_rows``.

The H200 command (the ``gguf`` part's engines each read and decode the 4.5 GB file once,
printed as the engine's start time)::

    python -m pagedlm.benchmarks.quantized_gpu --output-json /tmp/quantized_gpu.json
    python -m pagedlm.benchmarks.quantized_gpu --parts kernels --gemv-sweep --gemm-sweep \\
        --output-json /tmp/quantized_kernels.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import itertools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedlm.benchmarks import latency
from pagedlm.benchmarks.cli import parse_bench_args
from pagedlm.benchmarks.shapes import BUILTIN_SHAPES

H200_BANDWIDTH = 4.8e12
SHAPE = BUILTIN_SHAPES["llama-3-8b"]
Q4_0_BLOCK_BYTES = 18  # a float16 scale, then 16 bytes of nibbles per 32 weights


def add_args(parser: argparse.ArgumentParser) -> None:
    latency.add_args(parser)
    parser.set_defaults(model="llama-3-8b", batch_size=1, input_len=1024, output_len=256)
    group = parser.add_argument_group("quantized GPU benchmark")
    group.add_argument("--parts", nargs="+", default=["fp8", "gguf", "kernels"],
                       choices=["fp8", "gguf", "kernels"])  # fmt: skip
    group.add_argument("--gguf-dir", default=None, help="where the Q4_0 file goes (a temp dir)")
    group.add_argument(
        "--gguf-gemvs",
        nargs="+",
        default=["half", "float"],
        choices=["half", "float", "int8"],
        help="the batch-1 GGUF GEMVs to run W2 with",
    )
    group.add_argument(
        "--gemv-configs",
        default=None,
        help="run each W2 (bf16, FP8, each GGUF GEMV) once more with the GEMV tiles from "
        "this JSON file (PAGEDLM_GEMV_CONFIGS's form, e.g. tests/cuda/bench_gemv.py "
        "--best-json's)",
    )
    group.add_argument("--gemv-sweep", action="store_true")
    group.add_argument("--gemm-sweep", action="store_true")
    group.add_argument("--output-json", default=None)


def write_random_q4_0_gguf(path: Path, shape: dict[str, Any] = SHAPE, seed: int = 0) -> int:
    """An untied llama GGUF of ``shape`` with every matrix in Q4_0; returns its bytes."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    pool = rng.integers(0, 256, size=(4096, Q4_0_BLOCK_BYTES), dtype=np.uint8)
    # Scales near 0.003: weights of std ~0.014, so activations stay finite through 32 layers.
    scales = rng.uniform(0.002, 0.004, 4096).astype(np.float16)
    pool[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = hidden // heads
    blocks_cache: dict[tuple[int, int], np.ndarray] = {}

    def q4_0(rows: int, cols: int) -> np.ndarray:
        if (rows, cols) not in blocks_cache:  # one array per shape, shared by the layers
            count = rows * cols // 32
            tiled = np.resize(pool, (count, Q4_0_BLOCK_BYTES))
            blocks_cache[rows, cols] = tiled.reshape(rows, cols // 32 * Q4_0_BLOCK_BYTES)
        return blocks_cache[rows, cols]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_context_length(shape["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(shape["vocab_size"])
    writer.add_bos_token_id(shape["bos_token_id"])
    writer.add_eos_token_id(shape["eos_token_id"])
    q4 = gguf.GGMLQuantizationType.Q4_0
    ones = np.ones(hidden, dtype=np.float32)
    writer.add_tensor("token_embd.weight", q4_0(shape["vocab_size"], hidden), raw_dtype=q4)
    for layer in range(shape["num_hidden_layers"]):
        matrices = {
            "attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
            "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
            "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter),
        }  # fmt: skip
        for name, (rows, cols) in matrices.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", q4_0(rows, cols), raw_dtype=q4)
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", ones)
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", q4_0(shape["vocab_size"], hidden), raw_dtype=q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.stat().st_size


def _w2(args: argparse.Namespace, label: str, **overrides: Any) -> float:
    """W2's output tok/s with ``overrides`` of the engine flags (the engine freed after)."""
    import torch

    run_args = copy.copy(args)
    for key, value in overrides.items():
        setattr(run_args, key, value)
    print(f"--- W2 {label}", flush=True)
    start = time.perf_counter()
    tok_per_s = latency.run(run_args)["tok_per_s"]
    print(f"    ({label}: {time.perf_counter() - start:.0f} s with engine start)", flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return tok_per_s


def run_fp8(args: argparse.Namespace, results: dict[str, Any]) -> None:
    for table in _tile_tables(args):
        suffix = "_file_tiles" if table else ""
        with _tiles(table):
            if table or "bf16_tok_per_s" not in results:
                results[f"bf16{suffix}_tok_per_s"] = _w2(args, "bf16" + suffix)
            bf16 = results[f"bf16{suffix}_tok_per_s"]
            fp8 = _w2(args, "fp8" + suffix, quantization="fp8")
        results[f"fp8{suffix}_tok_per_s"] = fp8
        results[f"fp8{suffix}_speedup"] = fp8 / bf16
        print(
            f"FP8 W2{' (tiles from ' + table + ')' if table else ''}: {fp8:.1f} tok/s vs "
            f"bf16 {bf16:.1f} = {fp8 / bf16:.2f}x (target >= 1.8x)"
        )


def _tile_tables(args: argparse.Namespace) -> list[str | None]:
    """None (the default tiles), then ``--gemv-configs``' file if given."""
    return [None] + ([args.gemv_configs] if args.gemv_configs else [])


@contextlib.contextmanager
def _tiles(table: str | None):
    """The GEMV tiles of ``table`` (None: the defaults) for engines made inside."""
    from pagedlm_cuda.kernels import gemv as gemv_module

    with _env(gemv_module.CONFIGS_ENV, table):
        gemv_module._configs_from_env.cache_clear()
        try:
            yield
        finally:
            gemv_module._configs_from_env.cache_clear()


def run_gguf(args: argparse.Namespace, results: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(dir=args.gguf_dir) as directory:
        path = Path(directory) / "llama-3-8b-q4_0.gguf"
        start = time.perf_counter()
        size = write_random_q4_0_gguf(path)
        print(f"wrote {path} ({size / 1e9:.2f} GB) in {time.perf_counter() - start:.1f} s")
        bf16 = results.get("bf16_tok_per_s") or _w2(args, "bf16")
        results["bf16_tok_per_s"] = bf16
        from pagedlm_cuda.kernels.gguf_gemv_half import EXACT_GEMV_ENV
        from pagedlm_cuda.kernels.gguf_gemv_int8 import INT8_GEMV_ENV

        for table, gemv in itertools.product(_tile_tables(args), args.gguf_gemvs):
            suffix = ("" if gemv == "half" else f"_{gemv}") + ("_file_tiles" if table else "")
            label = f"{gemv} GEMV" + (f", tiles from {table}" if table else "")
            exact = "1" if gemv == "float" else "0"
            int8 = "1" if gemv == "int8" else "0"
            with _env(INT8_GEMV_ENV, int8), _env(EXACT_GEMV_ENV, exact), _tiles(table):
                q4 = _w2(args, f"gguf q4_0, {label}", model=str(path), load_format="auto")
            results[f"gguf_q4_0{suffix}_tok_per_s"] = q4
            results[f"gguf_q4_0{suffix}_speedup"] = q4 / bf16
            print(
                f"Q4_0 GGUF W2 ({label}): {q4:.1f} tok/s vs bf16 {bf16:.1f} = "
                f"{q4 / bf16:.2f}x (target >= 2.8x)"
            )


@contextlib.contextmanager
def _env(name: str, value: str | None):
    """``name`` set to ``value`` (None: unset) inside the block."""
    before = os.environ.get(name)
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def main(argv: list[str] | None = None) -> None:
    from pagedlm.benchmarks import quantized_kernels

    args = parse_bench_args(__doc__, add_args, argv)
    results: dict[str, Any] = {"model": args.model, "input_len": args.input_len,
                               "output_len": args.output_len, "batch_size": args.batch_size}  # fmt: skip
    if "fp8" in args.parts:
        run_fp8(args, results)
    if "gguf" in args.parts:
        run_gguf(args, results)
    if "kernels" in args.parts:
        bandwidth = args.bandwidth or H200_BANDWIDTH
        results["kernels"] = quantized_kernels.projection_times(SHAPE, bandwidth)
        if args.gemv_sweep:
            results["gemv_sweep"] = quantized_kernels.gemv_sweep(SHAPE)
        if args.gemm_sweep:
            results["gemm_sweep"] = quantized_kernels.gemm_sweep(SHAPE)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))
        print(f"results in {args.output_json}")


if __name__ == "__main__":
    main()
