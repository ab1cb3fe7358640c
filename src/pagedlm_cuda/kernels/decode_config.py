"""How the decode attention kernel splits its work, chosen from the batch size bucket.

A decode step has one query token per sequence, so the kernel's parallelism is
``num_seqs * num_kv_heads * partitions``. At batch 256 that is thousands of programs even
with long partitions; at batch 1 on an 8-kv-head model a 256-key partition leaves a
132-SM GPU mostly idle (8 heads x 5 partitions at 1,100 tokens). So the partition shrinks
as the batch does, aiming at ~512 programs for a 1,024-token context (fewer at the
smallest batches, where the 32-key floor binds): ``partition`` is the largest power of two
<= ``2 * bucket * num_kv_heads``, clamped to 32 .. 512.

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

MIN_PARTITION = 32
MAX_PARTITION = 512
FP8_BLOCK_N = 128
"""Key positions per tile for a float8 cache in long partitions: a tile of 128 E4M3 keys
is as many bytes as 64 bf16 ones. Measured on the H200 (W1's shape, batch 256 at 580
tokens, 512-key partitions, ``tests/cuda/bench_decode_attention.py --kv-cache-dtype fp8``):
181 us per call against 207 with 64-key tiles (4 warps, 2 stages; 8 warps or 3 stages
were slower). Short partitions (small batches) keep the bf16 choice."""
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
    the cache is float8 (see ``FP8_BLOCK_N``)."""
    programs = batch_bucket(num_seqs) * num_kv_heads
    partition = MIN_PARTITION
    while 2 * partition <= min(2 * programs, MAX_PARTITION):
        partition *= 2
    block_n = min(partition, 64 if head_dim <= 128 else 32)
    if fp8 and head_dim <= 128 and partition >= 4 * FP8_BLOCK_N:
        block_n = FP8_BLOCK_N
    merge_in_kernel = programs <= MERGE_IN_KERNEL_PROGRAMS
    return DecodeConfig(partition, block_n, num_warps=4, num_stages=2,
                        merge_in_kernel=merge_in_kernel)  # fmt: skip


def batch_invariant_config(head_dim: int) -> DecodeConfig:
    """The one split every launch uses in batch-invariant mode, whatever the batch: a
    token's keys are cut at the same partition boundaries, walked in the same tiles and
    merged in the same order whether it is a decode or a row of a prefill chunk (which
    that mode runs through the decode kernel too). 256-key partitions keep a long context
    parallel at batch 1 without many partials at batch 256; the merge is a kernel of its
    own, so no ticket counters are involved."""
    return DecodeConfig(256, 64 if head_dim <= 128 else 32, num_warps=4, num_stages=2,
                        merge_in_kernel=False)  # fmt: skip
