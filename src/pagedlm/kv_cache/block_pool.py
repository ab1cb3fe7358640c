"""The pool of KV blocks: reference counts, an LRU free queue and the prefix-cache index.

A block is in exactly one of three states:

- in use: ``ref_cnt > 0``; not in the free queue. Its hash (if any) is in the index.
- free and cached: ``ref_cnt == 0``, in the free queue, hash still in the index, so a
  later request with the same prefix can take it back (a cache hit).
- free and blank: ``ref_cnt == 0``, in the free queue, no hash.

Allocation takes blocks from the head of the free queue (least recently freed) and drops
their hash; freeing appends to the tail. A hit on a free cached block removes it from the
middle of the queue, which the ``OrderedDict`` does in O(1). A pool made ``consecutive``
(for a platform whose attention reads consecutive blocks in place) takes, block by block,
the free block after the one it took last (after ``after``, the request's last block, for
the first), wherever it sits in the queue, and the queue's head only where that one is
held: a request's table then runs on in consecutive blocks where it can. A cached block
taken that way loses its hash out of LRU order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from pagedlm.kv_cache.events import EventLog
from pagedlm.kv_cache.hashing import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """Bookkeeping for one block of ``block_size`` token slots (the storage lives elsewhere).

    Mutable on purpose: the pool updates ``ref_cnt`` and ``block_hash`` in place, and
    requests hold references to the same objects. Identity is the object, not its fields.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    """Set while the block is full, cached and findable in the pool's index."""


class BlockPool:
    """Owns every ``KVCacheBlock``; hands them out, takes them back, indexes full ones.

    Invariants:
    - ``num_free_blocks + (blocks with ref_cnt > 0) == num_blocks``.
    - ``block.block_hash is not None`` iff the index maps that hash to that block.
    - With caching disabled no block is ever hashed.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, consecutive: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}.")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.consecutive = consecutive
        """Allocations prefer the free block after the last one taken (module doc)."""
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self._free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (block.block_id, block) for block in self.blocks
        )
        self._cached: dict[BlockHash, KVCacheBlock] = {}
        self.event_log: EventLog | None = None
        """Where evictions and resets are recorded for KV-cache events (None: not kept)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner, cached or not: what an allocation may take."""
        return len(self._free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int, after: int | None = None) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blank blocks from the head of the free queue (ref_cnt 1 each);
        in a ``consecutive`` pool, each the block after the one taken before it (after
        ``after``, a block id, for the first) where that one is free.

        Cached blocks taken this way lose their hash: their content is about to be
        overwritten. Callers check ``num_free_blocks`` first.
        """
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(
                f"asked for {num_blocks} blocks with {self.num_free_blocks} free; "
                "check num_free_blocks before allocating."
            )
        taken = []
        following = None if after is None or not self.consecutive else after + 1
        for _ in range(num_blocks):
            if following is not None and following in self._free_queue:
                block = self._free_queue.pop(following)
            else:
                _, block = self._free_queue.popitem(last=False)
            if self.consecutive:
                following = block.block_id + 1
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each block (a cache hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference from each block, in the given order.

        Blocks that reach zero go to the tail of the free queue and keep their hash, so
        the first ones given here are the first to be evicted.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken.")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block.block_id] = block

    def cache(self, block: KVCacheBlock, block_hash: BlockHash) -> bool:
        """Index a full block under ``block_hash``; True if it entered the index now.

        If another block already holds that hash (two requests filled the same prefix
        before either was indexed), the index keeps the first and this one stays
        unhashed: it is still valid for its owner, just not shared.
        """
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def uncache(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the index (no request may hit it again); it stays with its
        owners, and goes back blank once they free it."""
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (returns False) while any block is in use,
        because running requests may still be about to hit them."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self.event_log is not None:
            self.event_log.cleared()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.event_log is not None:
                self.event_log.removed(block.block_hash)
            block.block_hash = None
