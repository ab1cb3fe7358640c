"""The offloading connector (vLLM's ``OffloadingConnector``; ``--kv-offloading-size`` turns
it on): a second tier under the prefix cache, in host memory.

Every full block of a scheduled request whose tokens are known (a prompt's, or one filled by
generated tokens; its prefix-cache hits included, as vLLM's connector stores every block
the pool lacks, not only those the request computes) is copied into a bounded pool of host
blocks under its chained prefix digest (``kv_cache/hashing.py``:
its tokens, every token before it, and its adapter, cache salt, image and embedding keys),
the least recently used block giving way when the pool is full. A later request whose
prompt continues, after its prefix-cache hit, with blocks the pool holds loads them in a
step of its own (``core/external_kv.py``) instead of computing them, so a prefix evicted
from the device cache by other prompts comes back at the cost of a copy.

A request that fails in a step (finish reason "error": a step that could not read its LoRA
adapter ran it without) may have had blocks copied to the pool under digests whose keys and
values they do not hold: ``request_finished`` forgets every block that request stored.

The pool's index lives with the scheduler (``host_pool.HostBlockIndex``): it picks the host
block of every save and of every load, so the scheduler's view of the pool is never stale.
The workers hold the bytes (``host_pool.HostKVStore``) and copy in step order: a step's
loads before its forward, its saves after it. A load whose host block no longer holds the
planned digest (evicted after the scheduler looked it up) is reported failed, and that
block and the ones after it are computed.

Options (``kv_connector_extra_config``, vLLM's names): ``cpu_bytes_to_use`` (the pool's
bytes; ``kv_offloading_size`` GiB sets it) or ``num_cpu_blocks`` (vLLM's earlier key: a
block count); ``block_size`` (must be the cache's), ``eviction_policy`` ("lru") and
``spec_name`` ("CPUOffloadingSpec") are accepted for vLLM's configurations.

Differences from vLLM's: transfers are synchronous steps of the framework (a load takes a
step of its own; saves are queued on the device's stream after the forward, not run by a
separate thread); host blocks are the cache's blocks (vLLM may group several into one);
only LRU eviction (vLLM also has ARC); the pool also works on the CPU platform (vLLM's needs
a CUDA-like GPU); the pool forgets everything when the prefix cache is reset (sleep, new
weights).
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

from pagedlm.kv_cache.hashing import update_block_hashes
from pagedlm.kv_transfer.base import KVConnectorBase, KVConnectorRole, kv_untrusted
from pagedlm.kv_transfer.bookkeeping import (
    RequestTables,
    StepReport,
    loadable_tokens,
    read_loads,
)
from pagedlm.kv_transfer.host_pool import HostBlockIndex, HostKVStore
from pagedlm.kv_transfer.offloading_config import (
    check_extra_config,
    host_block_bytes,
    num_host_blocks,
)
from pagedlm.step.kv_transfer import BlockTransfer, KVConnectorMetadata, KVConnectorOutput

if TYPE_CHECKING:
    from pagedlm.config import EngineConfig
    from pagedlm.core.request import Request
    from pagedlm.kv_transfer.kv_blocks import KVCacheBlocks
    from pagedlm.step import SchedulerOutput

logger = logging.getLogger(__name__)


class OffloadingConnector(KVConnectorBase):
    """Blocks of KV kept in a host-memory pool (module doc)."""

    def __init__(self, config: EngineConfig, role: KVConnectorRole) -> None:
        super().__init__(config, role)
        self.block_size = config.cache.block_size
        self.num_host_blocks = num_host_blocks(config)
        # Scheduler side.
        self.index = HostBlockIndex(self.num_host_blocks)
        self._requests = RequestTables()
        self._next_block: dict[str, int] = {}
        """Per scheduled request, the first of its blocks not yet considered for saving."""
        self._stored_by: dict[str, list[bytes]] = {}
        """Per request, the digests its saves put into the pool (forgotten if it fails)."""
        self._planned_loads: list[BlockTransfer] = []
        self.num_saved_blocks = 0
        # Worker side.
        self._blocks: KVCacheBlocks | None = None
        self._store: HostKVStore | None = None
        self._report = StepReport()
        if role == KVConnectorRole.SCHEDULER:
            logger.info(
                "KV offloading: %d host blocks of %d tokens (%.2f GiB)",
                self.num_host_blocks,
                self.block_size,
                self.num_host_blocks * host_block_bytes(config) / 2**30,
            )

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        assert config.kv_transfer is not None
        if config.kv_transfer.kv_role != "kv_both":
            raise ValueError(
                f"{config.kv_transfer.kv_connector} keeps this engine's own host pool, which "
                f"it both fills and reads: kv_role must be 'kv_both', not "
                f"{config.kv_transfer.kv_role!r}."
            )
        check_extra_config(config)
        if num_host_blocks(config) < 1:
            raise ValueError(
                f"The KV offloading pool holds no block: one block takes "
                f"{host_block_bytes(config)} bytes ({host_block_bytes(config) / 2**30:.6f} "
                "GiB); raise kv_offloading_size (or cpu_bytes_to_use) to at least that."
            )
        model = config.model
        if model.pooler is not None:
            from pagedlm.pooling.model_config import caches_prefixes

            if not caches_prefixes(model.arch, model.pooler):
                raise ValueError(
                    "KV offloading keeps prompts' KV for later prompts, and this pooling "
                    "model reuses none (its pooler reads every row, or its attention looks "
                    "ahead); drop kv_offloading_size / the OffloadingConnector."
                )

    # ---- scheduler side ------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return loadable_tokens(
            request,
            num_computed_tokens,
            self.block_size,
            lambda block_hash: block_hash in self.index,
        )

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._requests.add(request)
        hashes = update_block_hashes(request, self.block_size)
        first = request.num_computed_tokens // self.block_size
        self.index.touch(hashes[:first])  # its prefix-cache hits: their host copies stay
        if not num_external_tokens:
            return
        end = first + num_external_tokens // self.block_size
        keys = []
        for block_hash in hashes[first:end]:
            host = self.index.get(block_hash)
            keys.append(f"{-1 if host is None else host}:{block_hash.hex()}")
        self.index.touch(hashes[first:end])
        self._planned_loads.append(
            BlockTransfer(request.request_id, list(block_ids[first:end]), keys)
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # Loads first: the workers read them before this step's saves reuse host blocks.
        loads, self._planned_loads = self._planned_loads, []
        for req_id in self._requests.update(scheduler_output):
            self._next_block.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:  # first scheduled, or resumed
            # From its first block: those it hit in the prefix cache may have left the pool.
            self._next_block[new.req_id] = 0
        saves: list[BlockTransfer] = []
        for req_id, start in zip(
            scheduler_output.req_ids, scheduler_output.num_computed_tokens, strict=True
        ):
            transfer = self._blocks_to_save(req_id, start, scheduler_output)
            if transfer is not None:
                saves.append(transfer)
        return KVConnectorMetadata(loads=loads, saves=saves)

    def _blocks_to_save(
        self, req_id: str, start: int, scheduler_output: SchedulerOutput
    ) -> BlockTransfer | None:
        """The full blocks of ``req_id`` whose tokens are all known and whose KV is written
        by the end of this step (drafts and tokens still in flight are not known), prefix-cache
        hits included, not held by the pool yet. The request is in this step, so it holds
        them until it ends."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        end = min(start + scheduler_output.num_scheduled_tokens[req_id], request.num_tokens)
        first = self._next_block.get(req_id, start // self.block_size)
        last = end // self.block_size
        if first >= last:
            return None
        self._next_block[req_id] = last
        hashes = update_block_hashes(request, self.block_size)
        table = self._requests.table(req_id)
        block_ids, keys = [], []
        stored = self._stored_by.setdefault(req_id, [])
        for index in range(first, last):
            host = self.index.store(hashes[index])
            if host is not None:
                block_ids.append(table[index])
                keys.append(f"{host}:{hashes[index].hex()}")
                stored.append(hashes[index])
        self.num_saved_blocks += len(keys)
        return BlockTransfer(req_id, block_ids, keys) if keys else None

    def request_finished(self, request: Request) -> None:
        self._requests.finish(request.request_id)
        self._next_block.pop(request.request_id, None)
        stored = self._stored_by.pop(request.request_id, ())
        if kv_untrusted(request):
            # Saves still in flight write host blocks no digest names any more; a later
            # step that reuses such a block writes it after them (steps run in order).
            for digest in stored:
                self.index.discard(digest)

    def reset_cache(self) -> None:
        self.index.reset()

    # ---- worker side ---------------------------------------------------------------

    def register_kv_caches(self, blocks: KVCacheBlocks | None) -> None:
        self._blocks = blocks
        if blocks is None:
            return  # the pool stays: its contents are forgotten by the scheduler's reset
        if self._store is None:
            self._check_block_bytes(blocks)
            self._store = HostKVStore(
                self.num_host_blocks, blocks.pin_host_memory, blocks.empty_host
            )
        self._store.bind(blocks)

    def _check_block_bytes(self, blocks: KVCacheBlocks) -> None:
        """The pool was sized from the configuration (``host_block_bytes``); refuse blocks
        larger than that, which would take more host memory than the budget (latent
        attention kept expanded by a backend without it)."""
        tensors = 1 if blocks.shares_values else 2
        actual = math.prod(blocks.block_shape) * blocks.dtype.itemsize * tensors
        planned = host_block_bytes(self.config)
        if actual > planned:
            raise ValueError(
                f"This worker's KV blocks take {actual} bytes, more than the {planned} the "
                "offloading pool was sized for (the attention backend keeps latent "
                "attention expanded); set PAGEDLM_MLA_DISABLE=1 so the pool is sized for "
                "expanded keys and values, or use a backend with latent attention."
            )

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not metadata.loads:
            return
        assert self._blocks is not None and self._store is not None, "no KV cache registered"
        read = read_loads(metadata.loads, self._held_host_block)
        if read.block_ids:
            self._store.load(self._blocks, read.block_ids, read.contents)
        self._report.add(read.output)

    def _held_host_block(self, key: str) -> int | None:
        """The host block a load's key names, or None if it no longer holds that digest."""
        assert self._store is not None
        host, tag = _parse_key(key)
        return host if self._store.holds(host, tag) else None

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        if not metadata.saves:
            return
        assert self._blocks is not None and self._store is not None, "no KV cache registered"
        block_ids = [block_id for transfer in metadata.saves for block_id in transfer.block_ids]
        parsed = [_parse_key(key) for transfer in metadata.saves for key in transfer.keys]
        self._store.save(
            self._blocks, block_ids, [host for host, _ in parsed], [tag for _, tag in parsed]
        )
        self._report.add(KVConnectorOutput(num_saved_blocks=len(block_ids)))

    def get_connector_output(self) -> KVConnectorOutput | None:
        return self._report.take()


def _parse_key(key: str) -> tuple[int, str]:
    """A transfer key ``"<host block>:<digest hex>"`` (host block -1: not in the pool)."""
    host, _, tag = key.partition(":")
    return int(host), tag
