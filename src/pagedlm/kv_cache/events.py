"""What the prefix cache tells the outside world: blocks stored, removed, all cleared.

The structs are vLLM's KV-cache events, field for field and in its msgpack layout (array-like
structs, the event's class name as its tag), so consumers written for vLLM (KV-aware routers,
its ``kv_events_subscriber`` example) read them unchanged:

- ``BlockStored``: consecutive full blocks of one request entered the cache. Hashes in
  order, the hash of the block before the first (None: the first block of a prompt), the
  token ids of all of them, ``block_size``; ``lora_id`` and ``medium`` ("GPU" for device KV,
  as vLLM names it whatever the device).
- ``BlockRemoved``: cached blocks evicted (their slots are being reused).
- ``AllBlocksCleared``: the whole cache was reset.

One ``KVEventBatch`` per engine step that changed the cache, stamped with wall time.
Block hashes are this engine's 32-byte sha256 digests (``kv_cache.hashing``).
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM = "GPU"
"""vLLM's name for the engine's own KV blocks (device memory, or host memory on CPU)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the three events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    """No defaults on purpose: ``omit_defaults`` would drop them from the array, and
    vLLM's decoders expect every element."""


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class EventLog:
    """Events of the current step, in the order they happened; taken once per step.

    A cache without a log (``None`` in its place) records nothing: publishing costs
    nothing unless it is switched on.
    """

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []
        self._removed: list[bytes] = []

    def stored(
        self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], block_size: int
    ) -> None:
        self._flush_removed()
        self._events.append(BlockStored(hashes, parent, token_ids, block_size, None, MEDIUM))

    def removed(self, block_hash: bytes) -> None:
        # Evictions come one block at a time; consecutive ones travel as one event.
        self._removed.append(block_hash)

    def cleared(self) -> None:
        self._flush_removed()
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        self._flush_removed()
        events, self._events = self._events, []
        return events

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(self._removed, MEDIUM))
            self._removed = []
