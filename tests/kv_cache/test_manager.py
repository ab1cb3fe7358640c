"""KVCacheManager: block tables, prefix-cache hits, eviction and check-then-commit."""

from __future__ import annotations

from pagedlm.core.request import Request
from pagedlm.kv_cache.manager import KVCacheManager
from pagedlm.sampling_params import SamplingParams

BLOCK = 4


def _request(request_id: str, tokens: list[int], **params) -> Request:
    cache_salt = params.pop("cache_salt", None)
    return Request(request_id, tokens, SamplingParams(**params), cache_salt=cache_salt)


def _admit(manager: KVCacheManager, request: Request) -> list[int]:
    """Admit a waiting request with all its tokens, as the scheduler does; returns its table."""
    computed = manager.get_computed_blocks(request)
    num_new = request.num_tokens - computed.num_computed_tokens
    assert manager.allocate_slots(request, num_new, computed) is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request)


def _assert_all_free(manager: KVCacheManager) -> None:
    assert manager.num_free_blocks == manager.num_blocks
    assert all(block.ref_cnt == 0 for block in manager.pool.blocks)
    assert manager.usage == 0.0


def test_block_table_grows_with_tokens():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    request = _request("r", list(range(6)))
    assert manager.allocate_slots(request, 6) == [0, 1]
    request.num_computed_tokens = 6
    request.append_output_token_ids([100])
    assert manager.allocate_slots(request, 1) == []  # slot 6 is still in block 1
    request.num_computed_tokens = 7
    request.append_output_token_ids([101])
    assert manager.allocate_slots(request, 1) == []
    request.num_computed_tokens = 8
    request.append_output_token_ids([102])
    assert manager.allocate_slots(request, 1) == [2]
    assert manager.get_block_ids(request) == [0, 1, 2]
    manager.free(request)
    _assert_all_free(manager)


def test_prefix_hit_shares_blocks_and_counts_tokens():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    first = _request("a", list(range(12)))
    first_table = _admit(manager, first)
    second = _request("b", [*range(12), 99])
    computed = manager.get_computed_blocks(second)
    assert computed.num_computed_tokens == 12
    assert [b.block_id for b in computed.blocks] == first_table
    assert manager.prefix_cache_queries == 12  # lookups count only once committed
    assert manager.allocate_slots(second, 1, computed) == [3]
    assert manager.get_block_ids(second) == [*first_table, 3]
    assert [manager.pool.blocks[i].ref_cnt for i in first_table] == [2, 2, 2]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (12 + 13, 12)
    manager.free(first)
    manager.free(second)
    _assert_all_free(manager)


def test_hit_on_freed_blocks_and_miss_on_other_prefix():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    first = _request("a", list(range(9)))
    first_table = _admit(manager, first)
    manager.free(first)
    again = _request("b", list(range(9)))
    assert _admit(manager, again)[:2] == first_table[:2]
    other = _request("c", [7, *range(1, 9)])  # differs in the first token only
    assert manager.get_computed_blocks(other).num_computed_tokens == 0


def test_same_block_after_different_prefix_misses():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    _admit(manager, _request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    shifted = _request("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])  # block 1 equal, block 0 not
    assert manager.get_computed_blocks(shifted).num_computed_tokens == 0


def test_last_token_always_recomputed():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    _admit(manager, _request("a", list(range(8))))
    exact = _request("b", list(range(8)))  # two full blocks, both cached
    computed = manager.get_computed_blocks(exact)
    assert computed.num_computed_tokens == 4
    assert computed.num_computed_tokens <= exact.num_tokens - 1
    assert manager.get_computed_blocks(_request("c", list(range(5)))).num_computed_tokens == 4
    assert manager.get_computed_blocks(_request("d", list(range(4)))).num_computed_tokens == 0


def test_hits_end_a_block_early_for_proposers_reading_the_next_token():
    # An EAGLE head's KV at a block's last position was computed with the token after the
    # block, which the block's hash does not cover: that block is computed again.
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True, hits_end_a_block_early=True)
    _admit(manager, _request("a", [*range(12), 50]))
    other_next = _request("b", [*range(12), 60])
    assert manager.get_computed_blocks(other_next).num_computed_tokens == 8
    assert manager.get_computed_blocks(_request("c", list(range(5)))).num_computed_tokens == 0


def test_cache_salt_separates_prefixes():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    _admit(manager, _request("a", list(range(9)), cache_salt="alice"))
    assert manager.get_computed_blocks(_request("b", list(range(9)))).num_computed_tokens == 0
    bob = _request("c", list(range(9)), cache_salt="bob")
    assert manager.get_computed_blocks(bob).num_computed_tokens == 0
    alice = _request("d", list(range(9)), cache_salt="alice")
    assert manager.get_computed_blocks(alice).num_computed_tokens == 8


def test_least_recently_freed_block_is_evicted_first():
    manager = KVCacheManager(BLOCK, 4, enable_prefix_caching=True)
    old = _request("old", list(range(8)))
    new = _request("new", list(range(100, 108)))
    _admit(manager, old)
    manager.free(old)
    _admit(manager, new)
    manager.free(new)
    # Free queue: old's tail block, old's head block, new's tail, new's head.
    _admit(manager, _request("filler", [50, 51, 52]))  # one block: evicts old's tail block
    assert manager.get_computed_blocks(_request("x", [*range(8), 9])).num_computed_tokens == 4
    new_again = _request("y", [*range(100, 108), 9])
    assert manager.get_computed_blocks(new_again).num_computed_tokens == 8


def test_free_cached_hits_do_not_count_as_free_space():
    manager = KVCacheManager(BLOCK, 2, enable_prefix_caching=True)
    first = _request("a", list(range(8)))
    _admit(manager, first)
    manager.free(first)
    # 9 tokens: 2 cached blocks hit (both free) + 1 new block; nothing is left for it.
    longer = _request("b", [*range(8), 8])
    computed = manager.get_computed_blocks(longer)
    assert computed.num_computed_tokens == 8
    assert manager.allocate_slots(longer, 1, computed) is None
    # Nothing changed: still free, still cached, no table, no stats.
    _assert_all_free(manager)
    assert manager.get_block_ids(longer) == []
    assert manager.prefix_cache_queries == 8
    assert manager.get_computed_blocks(longer).num_computed_tokens == 8
    # Same 8 tokens: one hit + one fresh block fits; the fresh one is refilled and re-cached.
    same = _request("c", list(range(8)))
    _admit(manager, same)
    assert manager.num_free_blocks == 0
    manager.free(same)
    assert manager.get_computed_blocks(longer).num_computed_tokens == 8


def test_prompt_logprobs_requests_skip_the_cache():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    _admit(manager, _request("a", list(range(9))))
    wants_logprobs = _request("b", list(range(9)), prompt_logprobs=1)
    computed = manager.get_computed_blocks(wants_logprobs)
    assert (computed.num_computed_tokens, computed.num_queried_tokens) == (0, 0)


def test_caching_disabled_never_hits():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=False)
    first = _request("a", list(range(9)))
    _admit(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(_request("b", list(range(9)))).num_computed_tokens == 0
    assert first.block_hashes == []  # no hashing work at all
    assert manager.prefix_cache_queries == 0


def test_parallel_samples_share_prompt_blocks():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    children = [_request(f"p-{i}", list(range(10))) for i in range(3)]
    tables = [_admit(manager, child) for child in children]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    assert len({table[2] for table in tables}) == 3  # the partial tail block is private
    assert manager.pool.blocks[tables[0][0]].ref_cnt == 3
    assert manager.num_free_blocks == 8 - 2 - 3
    for child in children:
        manager.free(child)
    _assert_all_free(manager)


def test_blocks_hashed_as_soon_as_scheduled_tokens_fill_them():
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    chunked = _request("a", list(range(10)))
    assert manager.allocate_slots(chunked, 6) == [0, 1]  # first chunk: block 0 full
    follower = _request("b", list(range(10)))
    assert manager.get_computed_blocks(follower).num_computed_tokens == 4
    chunked.num_computed_tokens = 6
    manager.allocate_slots(chunked, 4)
    assert manager.get_computed_blocks(follower).num_computed_tokens == 8


def test_reset_prefix_cache():
    manager = KVCacheManager(BLOCK, 4, enable_prefix_caching=True)
    first = _request("a", list(range(9)))
    _admit(manager, first)
    assert not manager.reset_prefix_cache()
    manager.free(first)
    assert manager.reset_prefix_cache()
    assert manager.get_computed_blocks(_request("b", list(range(9)))).num_computed_tokens == 0


def test_consecutive_blocks_continue_a_prefix_hit_in_place():
    """A platform that reads consecutive blocks in place (``prefers_consecutive_blocks``):
    a request that hits a freed request's cached blocks gets the block after them, even
    where it is cached and the LRU head is blank; without it, the head."""
    for consecutive, expected, next_block in ((True, [0, 1, 2, 3], 4), (False, [0, 1, 2, 4], 5)):
        manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True,
                                 consecutive_blocks=consecutive)  # fmt: skip
        first = _request("a", list(range(16)))
        assert _admit(manager, first) == [0, 1, 2, 3]
        manager.free(first)  # free queue: 4, 5, 6, 7, then a's blocks tail first
        # The same prompt: blocks 0-2 hit (the last full block is recomputed), and one
        # more block for tokens 12-15: block 3 (cached, recently freed) or the head.
        again = _request("b", list(range(16)))
        assert _admit(manager, again) == expected
        again.append_output_token_ids([7])  # its first decode needs a fifth block
        assert manager.allocate_slots(again, 1) == [next_block]
        manager.free(again)
        _assert_all_free(manager)


def test_admissions_and_resets_are_counted_for_the_log_lines_window():
    """``prefix_cache_requests``: admissions that looked the cache up (not a resumed
    preemption, not a request that skips the cache); ``prefix_cache_resets``: resets that
    emptied it. The log line's hit rate covers the most recent of these requests."""
    manager = KVCacheManager(BLOCK, 8, enable_prefix_caching=True)
    first = _request("a", list(range(9)))
    _admit(manager, first)
    manager.free(first)
    _admit(manager, _request("b", list(range(9))))
    _admit(manager, _request("c", list(range(5)), prompt_logprobs=1))  # skips the cache
    resumed = _request("d", list(range(5)))
    resumed.num_preemptions = 1
    _admit(manager, resumed)
    assert (manager.prefix_cache_requests, manager.prefix_cache_queries) == (2, 18)
    assert not manager.reset_prefix_cache()  # blocks are held: nothing emptied
    assert manager.prefix_cache_resets == 0
    for request_id in "bcd":
        manager.free(_request(request_id, []))
    assert manager.reset_prefix_cache()
    assert manager.prefix_cache_resets == 1
