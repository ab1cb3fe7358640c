"""The host-memory pool of the offloading connector (``offloading.py``), in two halves.

``HostBlockIndex`` (scheduler side, pure Python) owns every fact about the pool: which
chained block digest is held in which host block, and their least-recently-used order. It
hands out host block numbers; the workers never decide anything.

``HostKVStore`` (worker side) holds the bytes: keys and values of ``num_blocks`` host
blocks, each ``[num_layers, block_size, num_kv_heads, head_dim]`` in the cache's dtype,
pinned where the platform pins host memory. It copies blocks between the device cache and
the pool in the order the steps arrive, on the device's stream, so a block saved by one
step is read back intact by any later step, and a step's loads read the pool before its
saves overwrite it. Each host block remembers the digest last written into it: a load
that finds another digest (or none) fails, and its request computes that block instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import torch

from pagedlm.kv_transfer.kv_blocks import KVCacheBlocks, as_bits


class HostBlockIndex:
    """Digest -> host block, with LRU eviction (module doc).

    Invariants: every host block number in ``[0, num_blocks)`` is either free or held by
    exactly one digest; ``_held`` iterates from the least to the most recently used."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self._held: OrderedDict[bytes, int] = OrderedDict()
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.num_evicted = 0
        """Digests pushed out to make room (cumulative)."""

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._held

    def get(self, digest: bytes) -> int | None:
        """The host block holding ``digest``, or None; recency unchanged."""
        return self._held.get(digest)

    def touch(self, digests: Iterable[bytes]) -> None:
        """Mark the held ones among ``digests`` as the most recently used, in order."""
        for digest in digests:
            if digest in self._held:
                self._held.move_to_end(digest)

    def store(self, digest: bytes) -> int | None:
        """A host block to write ``digest`` into, evicting the least recently used digest
        when none is free; None when ``digest`` is held already (it is touched instead)."""
        if digest in self._held:
            self._held.move_to_end(digest)
            return None
        if self._free:
            block = self._free.pop()
        else:
            _, block = self._held.popitem(last=False)
            self.num_evicted += 1
        self._held[digest] = block
        return block

    def discard(self, digest: bytes) -> None:
        """Forget ``digest`` (its host block becomes free)."""
        block = self._held.pop(digest, None)
        if block is not None:
            self._free.append(block)

    def reset(self) -> None:
        """Forget every digest."""
        self._held.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))


class HostKVStore:
    """The pool's bytes on one worker (module doc)."""

    def __init__(
        self,
        num_blocks: int,
        pin_memory: bool,
        empty_host: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
    ) -> None:
        self.num_blocks = num_blocks
        self.pin_memory = pin_memory
        self.empty_host = empty_host
        """Allocates the pool (``KVCacheBlocks.empty_host``: the platform's)."""
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.tags: list[str | None] = [None] * num_blocks
        """The digest (hex) last written into each host block."""

    def bind(self, blocks: KVCacheBlocks) -> None:
        """Allocate the pool for ``blocks``' block shape and dtype (once; kept across a
        device cache released and allocated again, as the shape does not change)."""
        shape = (self.num_blocks, *blocks.block_shape)
        if self.keys is not None and self.keys.shape == shape and self.keys.dtype == blocks.dtype:
            return
        self.keys = self.empty_host(shape, blocks.dtype)
        # A latent cache's keys are its values: held once.
        self.values = self.keys if blocks.shares_values else self.empty_host(shape, blocks.dtype)
        self.tags = [None] * self.num_blocks

    def save(
        self,
        blocks: KVCacheBlocks,
        block_ids: Sequence[int],
        host_blocks: Sequence[int],
        tags: Sequence[str],
    ) -> None:
        """Copy device blocks ``block_ids`` into host blocks ``host_blocks``; queued on the
        device's stream after the step's forward (pinned memory: no wait here)."""
        assert self.keys is not None and self.values is not None, "bind() first"
        keys, values = blocks.read(block_ids)  # [num_layers, n, ...] on the device
        for index, (host, tag) in enumerate(zip(host_blocks, tags, strict=True)):
            as_bits(self.keys[host]).copy_(as_bits(keys[:, index]), non_blocking=self.pin_memory)
            if self.values is not self.keys:
                as_bits(self.values[host]).copy_(
                    as_bits(values[:, index]), non_blocking=self.pin_memory
                )
            self.tags[host] = tag

    def load(
        self, blocks: KVCacheBlocks, block_ids: Sequence[int], host_blocks: Sequence[int]
    ) -> None:
        """Copy host blocks ``host_blocks`` into device blocks ``block_ids``, queued on the
        device's stream before the step's forward."""
        assert self.keys is not None and self.values is not None, "bind() first"
        shape = (len(block_ids), *blocks.block_shape)
        keys = torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
        shared = self.values is self.keys
        values = keys if shared else torch.empty(shape, dtype=blocks.dtype, device=blocks.device)
        for index, host in enumerate(host_blocks):
            as_bits(keys[index]).copy_(as_bits(self.keys[host]), non_blocking=self.pin_memory)
            if not shared:
                as_bits(values[index]).copy_(
                    as_bits(self.values[host]), non_blocking=self.pin_memory
                )
        blocks.write(block_ids, keys.transpose(0, 1), values.transpose(0, 1))

    def holds(self, host_block: int, tag: str) -> bool:
        """Whether ``host_block`` is a block of the pool that last received ``tag``."""
        return 0 <= host_block < self.num_blocks and self.tags[host_block] == tag
