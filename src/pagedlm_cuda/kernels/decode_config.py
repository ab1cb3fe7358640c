"""How the decode attention kernel splits its work, chosen from the batch size bucket.

A decode step has one query token per sequence, so the kernel's parallelism is
``num_seqs * num_kv_heads * partitions``. At batch 256 that is thousands of programs even
with long partitions; at batch 1 on an 8-kv-head model a 256-key partition leaves a
132-SM GPU mostly idle (8 heads x 5 partitions at 1,100 tokens). So the partition shrinks
as the batch does, aiming at ~512 programs for a 1,024-token context (fewer at the
smallest batches, where the 32-key floor binds): ``partition`` is the largest power of two
<= ``2 * bucket * num_kv_heads``, clamped to 32 .. 256.

The choice depends on the batch size, never on the data (sequence lengths), and only
through ``batch_bucket``: the smallest size of the CUDA-graph ladder
(``pagedlm_cuda.graph_runner.capture_sizes``) that holds ``num_seqs``. A graph captured
for a padded size and an eager step of any batch that pads to it therefore use the same
configuration and compute bit-identical results. A runner's ladder is the full ladder cut
at ``max_num_seqs`` plus ``max_num_seqs`` itself, so padding up to a ``max_num_seqs`` off
the full ladder stays within one bucket too (``tests/cuda/test_decode_config.py`` checks
every ``max_num_seqs`` below 600).

Tiles: large batches keep many programs resident per SM, where a 32-key tile (fewer
registers) was the autotuner's pick at batch 256 (docs/performance.md, earlier layout); small batches have few programs, each of which should keep
more bytes in flight, so they take 64-key tiles (32 with head_dim > 128, for shared
memory) and two pipeline stages.
"""

from __future__ import annotations

import bisect
import functools
from typing import NamedTuple

MIN_PARTITION = 32
MAX_PARTITION = 256


class DecodeConfig(NamedTuple):
    partition: int
    """Key positions per program (a multiple of ``block_n``)."""
    block_n: int
    """Key positions per loop iteration."""
    num_warps: int
    num_stages: int


@functools.cache
def _ladder() -> tuple[int, ...]:
    # Imported lazily: graph_runner imports the attention backend, which imports kernels.
    from pagedlm_cuda.graph_runner import capture_sizes

    return tuple(capture_sizes(1 << 16))


def batch_bucket(num_seqs: int) -> int:
    """The smallest CUDA-graph capture size >= ``num_seqs`` (of the unbounded ladder)."""
    ladder = _ladder()
    index = bisect.bisect_left(ladder, num_seqs)
    return ladder[min(index, len(ladder) - 1)]


@functools.cache
def decode_config(num_seqs: int, num_kv_heads: int, head_dim: int) -> DecodeConfig:
    """The decode kernel's split and tile for a batch of ``num_seqs`` (bucketed)."""
    programs = batch_bucket(num_seqs) * num_kv_heads
    partition = MIN_PARTITION
    while 2 * partition <= min(2 * programs, MAX_PARTITION):
        partition *= 2
    if partition == MAX_PARTITION:
        return DecodeConfig(partition, 32, num_warps=4, num_stages=2)
    block_n = min(partition, 64 if head_dim <= 128 else 32)
    return DecodeConfig(partition, block_n, num_warps=4, num_stages=2)
