"""Instructions per weight in the GGUF GEMV's loop, without a GPU.

    PYTHONPATH=src python tests/cuda/sass_gguf_gemv.py [--tiles 16,512,2,3 8,512,1,3]
        [--bits 4 8] [--mins] [--int8 | --half] [--group 16] [--show-loop]

Compiles ``gguf_gemv``'s kernel for sm_90 with Triton's own ``ptxas`` (pointers and sizes
16-divisible, as the JIT specializes llama-3-8b's shapes), disassembles it with the
bundled ``cuobjdump`` and counts the SASS of its main loop (the body that ends in the
backward branch): instructions per weight streamed, registers, shared memory and the
commonest opcodes. ``--show-loop`` prints the loop. Not a test and no timing: at batch 1
the kernel is bound by whichever is slower, the bytes or the instructions issued (one warp
instruction per cycle per SM quarter; integer logic at half the FP32 rate, ``I2F``
conversions at a quarter), so this says how far the arithmetic sits from the bytes
(``tests/cuda/bench_gemv.py --kinds gguf4`` times the kernel on a GPU). ``--int8``: the
kernel with x rounded to int8 and ``dp4a`` products (``gguf_gemv_int8``); ``--half``: the
kernel with float16 products (``gguf_gemv_half``; 4-bit codes, groups of 32).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedlm_cuda.kernels.gemv import GemvConfig
from pagedlm_cuda.kernels.gguf_gemv import LANES, MAGIC, _slice_products, gemv_kernel
from pagedlm_cuda.kernels.gguf_gemv_half import _slice_half_products
from pagedlm_cuda.kernels.gguf_gemv_int8 import _slice_terms

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*([^;]*)")


def compile_gemv(
    config: GemvConfig,
    bits: int,
    has_mins: bool,
    int8: bool = False,
    group: int = 32,
    half: bool = False,
) -> triton.compiler.CompiledKernel:
    kernel = gemv_kernel
    offset = (4 if bits == 4 else 32) if group == 16 else (8 if bits == 4 else 128)
    constants = dict(
        SLICE=_slice_terms if int8 else _slice_half_products if half else _slice_products,
        OFFSET=0 if has_mins else offset, BITS=bits, GROUP=group, HAS_MINS=has_mins,
        HAS_BIAS=False, BLOCK_N=config.block_n, BLOCK_G=config.block_k * bits // (LANES.value * 32),
        PIPELINE=config.pipeline_stages, EVEN_N=True, EVEN_K=True, SPLIT=1,
        EMULATE=False, USE_PDL=True,
    )  # fmt: skip
    scale_type = "*fp32" if has_mins or group == 16 else "*fp16"
    types = {"x_ptr": "*bf16", "codes_ptr": "*i32", "scales_ptr": scale_type,
             "mins_ptr": scale_type, "bias_ptr": "*bf16", "out_ptr": "*bf16",
             "partials_ptr": "*fp32", "counts_ptr": "*i32"}  # fmt: skip
    signature, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if name != "magic":
            attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constants, attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.pipeline_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def disassemble(kernel) -> tuple[str, str]:
    """(SASS, resource usage) of a compiled kernel."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "k.cubin")
        with open(path, "wb") as cubin:
            cubin.write(kernel.asm["cubin"])
        run = [os.path.join(TOOLS, "cuobjdump")]
        sass = subprocess.run([*run, "-sass", path], capture_output=True, text=True).stdout
        usage = subprocess.run([*run, "-res-usage", path], capture_output=True, text=True).stdout
    return sass, usage


def main_loop(sass: str, holding: str | None = None) -> list[tuple[int, str, str]]:
    """The instructions of the last loop in the code (address, opcode, operands); with
    ``holding``, of the shortest loop that has an opcode starting with it (the innermost
    of nested loops)."""
    code = [(int(m[1], 16), m[2], m[3]) for m in INSTRUCTION.finditer(sass)]
    at = {address: i for i, (address, _, _) in enumerate(code)}
    loop: list[tuple[int, str, str]] = []
    for i, (address, opcode, operands) in enumerate(code):
        target = re.search(r"0x([0-9a-f]+)", operands)
        if opcode.startswith("BRA") and target and int(target[1], 16) < address:
            start = at.get(int(target[1], 16))
            if start is None:
                continue
            candidate = code[start : i + 1]
            inner = not loop or len(candidate) < len(loop)
            if holding is None or (inner and any(op.startswith(holding) for _, op, _ in candidate)):
                loop = candidate
    return loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiles", nargs="+", default=["16,512,2,3", "8,512,1,3", "32,512,4,3"])
    parser.add_argument("--bits", nargs="+", type=int, default=[4, 8], choices=[4, 8])
    parser.add_argument("--mins", action="store_true", help="affine blocks (Q4_1, K-quants)")
    parser.add_argument("--int8", action="store_true", help="gguf_gemv_int8's kernel")
    parser.add_argument("--half", action="store_true", help="gguf_gemv_half's kernel")
    parser.add_argument(
        "--group", type=int, default=32, choices=[16, 32],
        help="columns per scale: 16 is Q3_K (4-bit codes) or Q6_K (8-bit)",
    )  # fmt: skip
    parser.add_argument("--show-loop", action="store_true")
    args = parser.parse_args()
    assert MAGIC.value == 0x4B000000
    for bits in args.bits:
        for tiles in args.tiles:
            config = GemvConfig(*(int(v) for v in tiles.split(",")))
            sass, usage = disassemble(
                compile_gemv(config, bits, args.mins, args.int8, args.group, args.half)
            )
            loop = main_loop(sass)
            weights = config.block_n * config.block_k / (32 * config.num_warps)
            counts = collections.Counter(opcode.split(".")[0] for _, opcode, _ in loop)
            registers = re.search(r"REG:(\d+)", usage)[1]
            top = ", ".join(f"{op} {n}" for op, n in counts.most_common(8))
            print(
                f"{bits}-bit {tuple(config)}: {len(loop) / weights:.2f} instructions per "
                f"weight ({len(loop)} for {weights:.0f} per thread), {registers} registers | {top}",
                flush=True,
            )
            if args.show_loop:
                print("\n".join(f"  {op} {operands}" for _, op, operands in loop))


if __name__ == "__main__":
    main()
