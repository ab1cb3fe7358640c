"""The ladder of batch sizes CUDA graphs are captured at (a leaf: the graph runner and the
decode kernel's configuration both read it)."""

from __future__ import annotations


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 (16 above 256) up to ``max_num_seqs``."""
    sizes = [s for s in (1, 2, 4) if s <= max_num_seqs]
    size = 8
    while size <= max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes
