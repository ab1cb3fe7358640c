"""Registers and shared memory of the decode kernel's tiles on an FP8 cache, without a GPU.

    PYTHONPATH=src:tests/cuda python tests/cuda/ptxas_decode_attention.py [--sass]
        [--cache bf16] [--loop] [--max-registers N]

Compiles ``_decode_kernel`` for sm_90a (Triton's own ``ptxas``) at W1's shape (qwen3-0.6b:
group 2, head_dim 128, 512-key partitions, an E4M3 cache read into float16 tiles, the
step's K/V written by the kernel) and prints, per tile / warps / stages choice, the
registers per thread, spills, shared memory, the programs per SM they allow (65,536
registers, 227 KiB) and the MMA kinds chosen. Not a test, and no timing: it shows which
tiles can keep more bytes in flight per SM (``tests/cuda/bench_decode_attention.py``
times them). ``--sass`` adds the instructions of the key loop per K/V element and its
commonest opcodes (``sass_gguf_gemv``'s disassembly); ``--cache bf16`` compiles the bf16
cache's kernel instead; ``--loop`` the variant whose programs loop over partitions (large
batches, ``DecodeConfig.slots``); ``--max-registers`` caps registers per thread.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
import triton.language as tl
from sass_gguf_gemv import disassemble, main_loop
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedlm_cuda.kernels.decode_attention import _decode_kernel

CONFIGS = [  # (block_n, warps, stages)
    (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
]  # fmt: skip
HEADS, KV_HEADS, BLOCK, DIM = 16, 8, 16, 128
POINTERS = {"key_cache_ptr": "*fp8e4nv", "value_cache_ptr": "*fp8e4nv", "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32", "slot_mapping_ptr": "*i32", "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32", "partial_out_ptr": "*fp32", "partial_lse_ptr": "*fp32",
            "counters_ptr": "*i32"}  # fmt: skip
INTS = {"q_stride_token": HEADS * DIM, "out_stride_token": HEADS * DIM,
        "new_key_stride_token": 3 * KV_HEADS * DIM, "new_value_stride_token": 3 * KV_HEADS * DIM,
        "cache_stride_block": KV_HEADS * BLOCK * DIM, "cache_stride_head": BLOCK * DIM,
        "block_table_stride": 64, "max_partitions": 8, "num_heads": HEADS,
        "num_kv_heads": KV_HEADS, "window": 0, "group_size": HEADS // KV_HEADS}  # fmt: skip


def compile_config(
    block_n: int, warps: int, stages: int, fp8: bool = True, loop: bool = False,
    max_registers: int = 0,
) -> dict:  # fmt: skip
    constants = dict(
        BLOCK_SIZE=BLOCK, PARTITION=512, BLOCK_N=block_n, BLOCK_G=16, BLOCK_D=DIM, MERGE_G=2,
        MERGE_P=4, MERGE_IN_KERNEL=False, DIRECT=False, LOOP=loop, WRITE_NEW=True,
        USE_WINDOW=False, USE_SOFT_CAP=False, FP8=fp8,
        COMPUTE_DTYPE=tl.float16 if fp8 else tl.bfloat16,
        ROTARY=False, IS_NEOX=True, QK_NORM=False, USE_PDL=True,  # W1's batch: no fused rotary
        HAS_SINKS=False,
    )  # fmt: skip
    signature, attrs = {}, {}
    for index, name in enumerate(_decode_kernel.arg_names):
        if name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            kind = POINTERS.get(name, "*bf16")
            signature[name] = "*bf16" if kind == "*fp8e4nv" and not fp8 else kind
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in ("score_scale", "cap_log2e", "norm_eps"):
            signature[name] = "fp32"
        else:  # strides not listed are 128 (head stride, slot stride, head_dim)
            signature[name] = "i32"
            value = INTS.get(name, DIM)
            if value % 16 == 0 and name not in ("block_table_stride", "max_partitions"):
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(_decode_kernel, signature, constants, attrs)
    options = {"num_warps": warps, "num_stages": stages}
    if max_registers:
        options["maxnreg"] = max_registers
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    with tempfile.TemporaryDirectory() as folder:
        with open(f"{folder}/k.ptx", "w") as ptx:
            ptx.write(kernel.asm["ptx"])
        info = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", f"{folder}/k.ptx", "-o", f"{folder}/k.cubin"],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    registers = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", info).group(1))
    mma = sorted(set(re.findall(r"versionMajor = (\d)", kernel.asm["ttgir"])))
    programs = min(65536 // (registers * 32 * warps), 232448 // kernel.metadata.shared)
    loop = main_loop(disassemble(kernel)[0], holding="HMMA")  # the key loop
    per_element = len(loop) / (2 * block_n * DIM / (32 * warps))  # a key and a value each
    opcodes = collections.Counter(opcode.split(".")[0] for _, opcode, _ in loop)
    return dict(registers=registers, spills=spills, shared=kernel.metadata.shared,
                programs=programs, mma="+".join(f"v{v}" for v in mma),
                per_element=per_element, opcodes=opcodes.most_common(8))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sass", action="store_true")
    parser.add_argument("--cache", choices=["fp8", "bf16"], default="fp8")
    parser.add_argument(
        "--loop", action="store_true", help="programs that loop over partitions (large batches)"
    )  # fmt: skip
    parser.add_argument("--max-registers", type=int, default=0, help="Triton's maxnreg")
    args = parser.parse_args()
    print(f"{args.cache} cache")
    print("block_n warps stages | regs spill smem(B) programs/SM mma")
    for block_n, warps, stages in CONFIGS:
        r = compile_config(
            block_n, warps, stages, args.cache == "fp8", args.loop, args.max_registers
        )  # fmt: skip
        print(f"{block_n:7d} {warps:5d} {stages:6d} | "
              f"{r['registers']:4d} {r['spills']:5d} {r['shared']:7d} {r['programs']:11d} "
              f"{r['mma']}", flush=True)  # fmt: skip
        if args.sass:
            top = ", ".join(f"{op} {n}" for op, n in r["opcodes"])
            print(f"  loop: {r['per_element']:.2f} instructions per K/V element | {top}")


if __name__ == "__main__":
    main()
