"""Reading and writing the paged KV cache on CPU: the CPU attention backend's gathers.

Keys are gathered by whole blocks (``index_select`` of ``[block_size, kv_heads,
head_dim]`` rows), which copies far larger contiguous pieces than a per-slot gather, into
workspaces kept across calls: a fresh multi-MB tensor per layer costs more in page faults
(transparent huge pages are zeroed on first touch) than the copy itself. An FP8 cache is
written quantized and read as bytes (torch's CPU index kernels have no float8 variants),
then dequantized.
"""

from __future__ import annotations

import torch

from pagedlm.attention.backend import BatchLayout
from pagedlm.kv_cache import fp8


def blocks_for(layout: BatchLayout, seq_len: int) -> int:
    """How many blocks hold key positions ``0 .. seq_len-1``; a ValueError if the step's
    block table is narrower than that."""
    num_blocks = -(-seq_len // layout.block_size)
    if layout.block_table.shape[1] < num_blocks:
        raise ValueError(
            f"a request needs {num_blocks} blocks of {layout.block_size} slots but the "
            f"block table has {layout.block_table.shape[1]} columns; the model runner "
            "must pass a block table covering every position."
        )
    return num_blocks


def write(
    cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor, scale: torch.Tensor | None
) -> None:
    """Store ``new`` [num_tokens, kv_heads, head_dim] at its slots; an FP8 cache gets it
    quantized (saturating), copied as bytes (CPU ``index_copy_`` has no float8 kernel)."""
    rows = cache.view(-1, *new.shape[1:])
    if scale is None:
        rows.index_copy_(0, slot_mapping, new if new.dtype == cache.dtype else new.to(cache.dtype))
    else:
        rows.view(torch.uint8).index_copy_(
            0, slot_mapping, fp8.quantize(new, scale).view(torch.uint8)
        )


class GatherWorkspaces:
    """Two block workspaces (0 keys, 1 values) that gathers land in, and two head-major
    workspaces for copies in ``[requests, kv_heads, keys, head_dim]`` order, each grown as
    needed and kept across steps. Not reentrant: what one gather returns stays valid only
    until the next gather into the same workspace."""

    def __init__(self) -> None:
        self._blocks: list[torch.Tensor | None] = [None, None]
        self._heads: list[torch.Tensor | None] = [None, None]

    def gather(self, which: int, cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """[len(block_ids) * block_size, kv_heads, head_dim] the cache rows of the blocks,
        in workspace ``which`` (0 keys, 1 values); valid until the next gather into it."""
        blocks = self.blocks(which, cache, block_ids.shape[0])
        torch.index_select(cache, 0, block_ids, out=blocks)
        return blocks.view(-1, cache.shape[-2], cache.shape[-1])

    def read(
        self,
        which: int,
        cache: torch.Tensor,
        block_ids: torch.Tensor,
        dtype: torch.dtype,
        scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The blocks' keys or values in ``dtype`` (dequantized from FP8 with ``scale``)."""
        if scale is None:
            return self.gather(which, cache, block_ids).to(dtype)
        # torch's CPU index kernels have no float8 variants: gather the bytes.
        rows = self.gather(which, cache.view(torch.uint8), block_ids)
        return fp8.dequantize(rows.view(cache.dtype), scale, dtype)

    def blocks(self, which: int, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """[num_blocks, *cache.shape[1:]] rows of block workspace ``which``."""
        numel = num_blocks * cache[0].numel()
        workspace = self._blocks[which]
        if (
            workspace is None
            or workspace.numel() < numel
            or workspace.dtype != cache.dtype
            or workspace.device != cache.device
        ):
            # Headroom: contexts grow a block at a time, reallocating each time would be
            # the cost the workspace exists to avoid.
            workspace = torch.empty(numel * 5 // 4, dtype=cache.dtype, device=cache.device)
            self._blocks[which] = workspace
        return workspace[:numel].view(num_blocks, *cache.shape[1:])

    def heads(self, which: int, like: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor of ``like``'s shape and dtype in head workspace ``which``."""
        numel = like.numel()
        workspace = self._heads[which]
        if workspace is None or workspace.numel() < numel or workspace.dtype != like.dtype:
            workspace = torch.empty(numel * 5 // 4, dtype=like.dtype, device=like.device)
            self._heads[which] = workspace
        return workspace[:numel].view(like.shape)
