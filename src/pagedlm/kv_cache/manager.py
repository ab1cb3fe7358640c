"""Per-request block tables on top of the ``BlockPool``, with prefix caching.

The scheduler asks two questions: which leading blocks of a waiting request are already
cached (``get_computed_blocks``), and whether a request can get slots for its next
tokens (``allocate_slots``, check-then-commit: it either commits everything or changes
nothing).

Blocks are hashed and indexed as soon as they are full of *scheduled* tokens, at
allocation time. Within a step the attention backend writes every new token's K/V before
any attention reads, so a request admitted later in the same step may already hit them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from pagedlm.core.request import Request
from pagedlm.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedlm.kv_cache.hashing import update_block_hashes


class ComputedBlocks(NamedTuple):
    """The cached prefix found for a request, to hand back to ``allocate_slots``.

    ``num_computed_tokens == len(blocks) * block_size``; ``num_queried_tokens`` is the
    number of tokens looked up (0 when no lookup happened), for the hit-rate counters.
    """

    blocks: tuple[KVCacheBlock, ...]
    num_computed_tokens: int
    num_queried_tokens: int


_NO_HIT = ComputedBlocks((), 0, 0)


class KVCacheManager:
    """Maps requests to blocks.

    Invariants:
    - A request's block table covers ``ceil(tokens_with_slots / block_size)`` blocks,
      where ``tokens_with_slots`` is its computed plus scheduled tokens.
    - The first ``_num_hashed[req_id]`` blocks of a table are full and were offered to
      the index (a block may stay unhashed when another block already holds its hash).
    - ``free`` returns every reference a request took, so after all requests finish
      every block has ``ref_cnt == 0``.
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_prefix_caching: bool,
        consecutive_blocks: bool = False,
        hits_end_a_block_early: bool = False,
    ) -> None:
        """``consecutive_blocks``: a request's fresh blocks continue its table where the
        blocks after its last one are free (a ``consecutive`` ``BlockPool``).
        ``hits_end_a_block_early``: a prefix hit leaves out its last block (vLLM's
        ``use_eagle``), for a speculative proposer whose KV at a position depends on the
        token after it (EAGLE and MTP heads): that block's last position was written with
        the next token of the request that filled it, which the block's hash does not
        cover."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}.")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching, consecutive_blocks)
        self.hits_end_a_block_early = hits_end_a_block_early
        self._tables: dict[str, list[KVCacheBlock]] = {}
        self._num_hashed: dict[str, int] = {}
        self.prefix_cache_queries = 0
        """Tokens looked up in the prefix cache by admitted requests (cumulative). A
        preempted request's lookup when it resumes is left out, as vLLM leaves it out of
        ``prefix_cache_queries``: it would mostly hit its own blocks and count its prompt
        again."""
        self.prefix_cache_hits = 0
        """Of those, tokens served from the cache (cumulative)."""
        self.prefix_cache_requests = 0
        """Admitted requests counted in ``prefix_cache_queries`` (cumulative)."""
        self.prefix_cache_resets = 0
        """Times ``reset_prefix_cache`` emptied the cache (cumulative)."""

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1]."""
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest run of cached full blocks at the start of ``request``'s tokens.

        At most ``(num_tokens - 1) // block_size`` blocks are returned, so at least the
        last token is always computed again and produces logits to sample from.
        Requests that want prompt logprobs skip the cache: they need every prompt
        position's logits; so do token-wise pooling requests, every position's hidden
        state. Nothing changes until the result is passed to ``allocate_slots``.
        """
        if (
            not self.enable_prefix_caching
            or request.sampling_params.prompt_logprobs is not None
            or (request.pooling is not None and request.pooling.token_wise)
        ):
            return _NO_HIT
        block_hashes = update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        if hits and self.hits_end_a_block_early:
            hits.pop()
        return ComputedBlocks(tuple(hits), len(hits) * self.block_size, request.num_tokens)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Fresh blocks ``allocate_slots(request, num_new_tokens)`` would take (no prefix
        hits): lets a caller check that several allocations all fit before making any."""
        num_tokens_with_slots = request.num_computed_tokens + num_new_tokens
        held = len(self._tables.get(request.request_id, ()))
        return max(0, -(-num_tokens_with_slots // self.block_size) - held)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: ComputedBlocks | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[int] | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens.

        The new tokens start after ``request.num_computed_tokens`` plus the cached prefix
        in ``new_computed_blocks`` (only for a request being admitted from waiting).
        Returns the ids of the freshly allocated blocks (cache hits not included; see
        ``get_block_ids`` for the whole table), or None when the free blocks do not
        suffice, in which case nothing changed. ``delay_cache_blocks``: index none of the
        new full blocks yet (their contents come from a KV connector's load, which may
        fail): ``cache_blocks`` does it once they are known good.
        """
        table = self._tables.get(request.request_id, [])
        if new_computed_blocks is None:
            # The common decode step: the slots are already held (a block lasts
            # block_size steps), so only a block that just filled may need hashing.
            num_tokens_with_slots = request.num_computed_tokens + num_new_tokens
            if num_tokens_with_slots <= len(table) * self.block_size:
                if self.enable_prefix_caching and min(
                    num_tokens_with_slots, len(request.all_token_ids)
                ) // self.block_size > self._num_hashed.get(request.request_id, 0):
                    self._cache_full_blocks(request, table, num_tokens_with_slots)
                return []
        computed = new_computed_blocks or _NO_HIT
        num_computed = request.num_computed_tokens + computed.num_computed_tokens
        num_tokens_with_slots = num_computed + num_new_tokens
        num_required = -(-num_tokens_with_slots // self.block_size)
        num_new_blocks = max(0, num_required - len(table) - len(computed.blocks))
        # Hits on free cached blocks take those blocks out of the free queue, so they
        # are no longer available for the fresh blocks.
        num_free_hits = sum(1 for block in computed.blocks if block.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None

        self.pool.touch(computed.blocks)
        last = computed.blocks[-1] if computed.blocks else (table[-1] if table else None)
        new_blocks = self.pool.allocate(num_new_blocks, None if last is None else last.block_id)
        table = self._tables.setdefault(request.request_id, [])
        table.extend(computed.blocks)
        table.extend(new_blocks)
        if computed.num_queried_tokens and not request.num_preemptions:
            self.prefix_cache_requests += 1
            self.prefix_cache_queries += computed.num_queried_tokens
            self.prefix_cache_hits += computed.num_computed_tokens
        if not delay_cache_blocks:
            self._cache_full_blocks(request, table, num_tokens_with_slots)
        return [block.block_id for block in new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Index ``request``'s full blocks among its first ``num_computed_tokens`` tokens
        (after ``allocate_slots(..., delay_cache_blocks=True)``, once their KV is known)."""
        table = self._tables.get(request.request_id)
        if table:
            self._cache_full_blocks(request, table, num_computed_tokens)

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (no-op if it holds none).

        Tail blocks are released first so they are evicted first: a block deep into one
        request's context is less likely to be shared than its leading blocks.
        """
        table = self._tables.pop(request.request_id, None)
        self._num_hashed.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))

    def uncache(self, request: Request) -> None:
        """Take ``request``'s blocks out of the prefix cache: their K/V may not be what
        their hashes promise (a step that failed the request may have run it without its
        LoRA adapter). Those of its table, and those its hashes still find: a request
        preempted or aborted while that step was in flight freed its blocks still hashed."""
        pool = self.pool
        for block in self._tables.get(request.request_id, ()):
            pool.uncache(block)
        for block_hash in request.block_hashes:
            block = pool.get_cached_block(block_hash)
            if block is not None:
                pool.uncache(block)

    def get_block_ids(self, request: Request) -> list[int]:
        """The request's whole block table (empty if it holds no blocks)."""
        return [block.block_id for block in self._tables.get(request.request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only possible while no request holds blocks."""
        reset = self.pool.reset_prefix_cache()
        self.prefix_cache_resets += reset
        return reset

    def _cache_full_blocks(
        self, request: Request, table: Sequence[KVCacheBlock], num_tokens_with_slots: int
    ) -> None:
        if not self.enable_prefix_caching:
            return
        # Slots may later be given to tokens not yet known (draft tokens of speculative
        # decoding); only blocks full of known tokens can be hashed.
        num_full = min(num_tokens_with_slots, request.num_tokens) // self.block_size
        start = self._num_hashed.get(request.request_id, 0)
        if num_full <= start:
            return
        block_hashes = update_block_hashes(request, self.block_size)
        if self.pool.event_log is None:
            for index in range(start, num_full):
                self.pool.cache(table[index], block_hashes[index])
        else:
            stored: list[int] = []
            for index in range(start, num_full):
                if self.pool.cache(table[index], block_hashes[index]):
                    stored.append(index)
                elif stored:
                    self._log_stored(request, block_hashes, stored)
                    stored = []
            if stored:
                self._log_stored(request, block_hashes, stored)
        self._num_hashed[request.request_id] = num_full

    def _log_stored(self, request: Request, block_hashes: list, indices: list[int]) -> None:
        """One ``BlockStored`` for a run of consecutive blocks that entered the index."""
        first, end = indices[0], indices[-1] + 1
        size = self.block_size
        self.pool.event_log.stored(
            block_hashes[first:end],
            block_hashes[first - 1] if first > 0 else None,
            list(request.all_token_ids[first * size : end * size]),
            size,
        )
