"""How the decode attention kernel splits its work, chosen from the batch size bucket.

A decode step has one query token per sequence, so the kernel's parallelism is
``num_seqs * num_kv_heads * partitions``. At batch 256 that is thousands of programs even
with long partitions; at batch 1 on an 8-kv-head model a 256-key partition leaves a
132-SM GPU mostly idle (8 heads x 5 partitions at 1,100 tokens). So the partition shrinks
as the batch does, aiming at ~512 programs for a 1,024-token context (fewer at the
smallest batches, where the 64-key floor binds): ``partition`` is the largest power of two
<= ``2 * bucket * num_kv_heads``, clamped to 64 .. 512; an FP8 cache's are 1,024 once
the batch alone gives 1,024 programs (``LARGE_PARTITION``).

The choice depends on the batch size, never on the data (sequence lengths), and only
through ``batch_bucket``: the smallest size of the CUDA-graph ladder
(``pagedlm_cuda.batch_sizes.capture_sizes``) that holds ``num_seqs``. A graph captured
for a padded size and an eager step of any batch that pads to it therefore use the same
configuration and compute bit-identical results. A runner's ladder is the full ladder cut
at ``max_num_seqs`` plus ``max_num_seqs`` itself, so padding up to a ``max_num_seqs`` off
the full ladder stays within one bucket too (``tests/cuda/test_decode_config.py`` checks
every ``max_num_seqs`` below 600).

Tiles: 64-key tiles (32 with head_dim > 128, for shared memory), 4 warps, two pipeline
stages. Measured on the H200 (qwen3-0.6b attention shape, bf16, block 16, 28 calls from a
graph): at batch 256 and 600 / 1,500-token contexts, 512-key partitions with 64-key tiles
reach 3.55 / 4.03 TB/s against 3.25 / 3.76 for the earlier 256 / 32 choice, and beat every
other tile of {32, 64, 128} keys x {4, 8} warps x {2, 3, 4} stages; the same holds at
batch 64 (3.75 TB/s). Small batches were measured with ``tests/cuda/bench_decode_attention.py``.
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

from pagedlm_cuda.batch_sizes import capture_sizes

MIN_PARTITION = 64
"""Measured on an H100 (session 19, llama-3-8b's attention at batch 1 over 1,100 keys,
``tests/cuda/bench_decode_attention.py --workloads W2``): 64-key partitions in one
64-key tile 4.4 us per call, against 5.2 for 32 keys (the earlier floor) and 6.8-11.5
for 128-256."""
MAX_PARTITION = 512
LARGE_PARTITION = 1024
"""Key positions per program of an FP8 cache once the batch alone gives
``LARGE_PARTITION`` programs or more (``bucket * num_kv_heads``). Measured on an H100
(session 19, W1's shape, batch 256 at 580 keys, qwen3-0.6b's 16 heads, ``--sweep``):
1,024-key partitions of 64-key tiles took 166.5 us per call against 174.2 for 512 keys
(188.0 for the earlier choice of 512 keys in 128-key tiles), and W1 with an FP8 cache
ran at 23,701 tok/s (21,901 with the earlier choice, session 18, another H100). A bf16
cache keeps 512: its kernel was faster with 1,024 too (224.9 against 236.0 us), but W1
with them ran at 18,114 tok/s, against 19,299 with 512 on the H100 of the call before
(not explained: W1's contexts reach 2,000 keys, unlike the sweep's 580; and two H100
machines differed). On the H200 (session 20, one call) W1 ran at 24,091 with 1,024-key
bf16 partitions against 24,160 with 512, so bf16 keeps 512; the same sweep for FP8 gave
161.3 us per call with 1,024 / 64, 163.1 with 1,024 / 128, 168.6 with 512 / 64."""

SLOT_PROGRAMS = 8192
"""Decode programs a batch bucket's grid aims at (``DecodeConfig.slots``): 8,192 / 256
sequences / 8 kv heads gives W1 4 programs per sequence, so its longest contexts (2,000
keys in 512-key partitions) stay one partition per program, while a grid sized by its
``max_model_len`` (4,096) had 8, of which a 600-key context used 2. Measured on an H100
(session 28, ``bench_decode_attention.py --num-heads 16 --slots 0 4 --ragged 200 2048
--grid-lens 4096 40960``, batch 256 at 200-2,048 keys, bf16): 434.1 us per call with
one program per partition of 4,096 against 426.5 with 4 slots, and 609.8 against 428.0
with the grid sized by Qwen3's 40,960; W1 (max_model_len 4,096) 19,628 and 19,621 tok/s
against 19,584 and 19,590."""

FP8_MAX_REGISTERS = 128
"""An FP8 cache's kernel at large batches (``slots`` > 0) is capped at 128 registers per
thread: 4 programs per SM instead of 3 (168 registers uncapped; 48 bytes of spills in
sm_90 SASS, none in the key loop's count: 4.59 -> 4.63 instructions per K/V element).
Measured on an H100 (session 28), W1-like contexts (batch 256, 200-2,048 keys, qwen3-0.6b,
``bench_decode_attention.py --kv-cache-dtype fp8 --slots 4 --ragged 200 2048
--max-registers 0 112 120 128``): 297.5 us per call uncapped, 282.5 at 112, 277.4 at 120,
**268.8** at 128; W1 with an FP8 cache 24,846 and 24,886 tok/s capped against 24,455 and
24,376 (alternating, one call). bf16's kernel (128 registers there, 4 per SM already)
lost with a cap of 102 (5 per SM): 444.8 against 426.5 us."""

MERGE_IN_KERNEL_PROGRAMS = 256
"""Batch bucket x kv heads up to which the decode kernel merges its own partitions."""


class DecodeConfig(NamedTuple):
    partition: int
    """Key positions per program (a multiple of ``block_n``)."""
    block_n: int
    """Key positions per loop iteration."""
    num_warps: int
    num_stages: int
    merge_in_kernel: bool
    """Whether the program with the last ticket merges the partitions (one launch), or a
    merge kernel follows. Measured on the H200: at batch 1 (llama-3-8b) the in-kernel merge
    saves ~7 us per layer; at batch 256 (qwen3-0.6b, 100-2,000-token contexts) it costs
    ~5% of the attention time (a ticket and fence per program). In between: a guess."""
    slots: int = 0
    """Programs per (sequence, kv head); 0: one per partition of ``max_seq_len``. With
    fewer, program ``i`` takes partitions ``i, i + slots, ...`` of its sequence (counted
    from the sliding window's first), so the grid does not grow with ``max_seq_len``
    (``max_model_len`` under a graph) past what the batch needs. Each partition is
    computed and merged as with one program each: the results do not depend on it."""
    max_registers: int = 0
    """A cap on the kernel's registers per thread (Triton's ``maxnreg``), so more programs
    fit on an SM; 0: the compiler's choice."""


@functools.cache
def _ladder() -> tuple[int, ...]:
    return tuple(capture_sizes(1 << 16))


def batch_bucket(num_seqs: int) -> int:
    """The smallest CUDA-graph capture size >= ``num_seqs`` (of the unbounded ladder)."""
    ladder = _ladder()
    index = bisect.bisect_left(ladder, num_seqs)
    return ladder[min(index, len(ladder) - 1)]


@functools.cache
def decode_config(
    num_seqs: int, num_kv_heads: int, head_dim: int, fp8: bool = False
) -> DecodeConfig:
    """The decode kernel's split and tile for a batch of ``num_seqs`` (bucketed); ``fp8``:
    the cache is float8, which takes the same tiles since session 19 (session 14 on the
    H200 had measured 128-key tiles faster for it, 181 against 207 us at W1's shape; after
    session 16's value stager the H100 measured 64 keys faster, 174.2 against 188.0) and
    longer partitions at large batches (``LARGE_PARTITION``)."""
    programs = batch_bucket(num_seqs) * num_kv_heads
    partition = MIN_PARTITION
    while 2 * partition <= min(2 * programs, MAX_PARTITION):
        partition *= 2
    if fp8 and programs >= LARGE_PARTITION:
        partition = LARGE_PARTITION
    block_n = min(partition, 64 if head_dim <= 128 else 32)
    merge_in_kernel = programs <= MERGE_IN_KERNEL_PROGRAMS
    # Small batches (those that merge in the kernel) keep one program per partition:
    # those read their first tile before the PDL wait, which a looping program does not,
    # and at batch 1 (W2) every partition is wanted at once.
    slots = 0 if merge_in_kernel else max(1, SLOT_PROGRAMS // programs)
    max_registers = FP8_MAX_REGISTERS if fp8 and slots else 0
    return DecodeConfig(partition, block_n, num_warps=4, num_stages=2,
                        merge_in_kernel=merge_in_kernel, slots=slots,
                        max_registers=max_registers)  # fmt: skip


def batch_invariant_config(head_dim: int) -> DecodeConfig:
    """The one split every launch uses in batch-invariant mode, whatever the batch: a
    token's keys are cut at the same partition boundaries, walked in the same tiles and
    merged in the same order whether it is a decode or a row of a prefill chunk (which
    that mode runs through the decode kernel too). 256-key partitions keep a long context
    parallel at batch 1 without many partials at batch 256; the merge is a kernel of its
    own, so no ticket counters are involved."""
    return DecodeConfig(256, 64 if head_dim <= 128 else 32, num_warps=4, num_stages=2,
                        merge_in_kernel=False)  # fmt: skip
