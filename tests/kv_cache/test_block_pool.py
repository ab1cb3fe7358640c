"""BlockPool (refcounts, LRU free queue, hash index) and block hashing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedlm.core.request import Request
from pagedlm.kv_cache.block_pool import BlockPool
from pagedlm.kv_cache.hashing import hash_block_tokens, update_block_hashes
from pagedlm.sampling_params import SamplingParams


def _digest(i: int) -> bytes:
    return hash_block_tokens(None, [i])


def _free_order(pool: BlockPool) -> list[int]:
    """Block ids in the order allocation would take them (drains and restores the pool)."""
    blocks = pool.allocate(pool.num_free_blocks)
    pool.free(blocks)
    return [block.block_id for block in blocks]


# ------------------------------------------------------------------------------ pool


def test_allocate_from_head_free_to_tail():
    pool = BlockPool(4, enable_caching=True)
    first = pool.allocate(2)
    assert [b.block_id for b in first] == [0, 1]
    assert all(b.ref_cnt == 1 for b in first)
    assert pool.num_free_blocks == 2
    assert pool.usage == pytest.approx(0.5)
    pool.free(first)
    assert pool.num_free_blocks == 4
    assert _free_order(pool) == [2, 3, 0, 1]


def test_touch_removes_free_block_from_middle_and_counts_refs():
    pool = BlockPool(4, enable_caching=True)
    block = pool.blocks[2]
    pool.touch([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 3
    pool.touch([block])  # a second owner: no queue change
    assert block.ref_cnt == 2
    assert pool.num_free_blocks == 3
    pool.free([block])
    assert pool.num_free_blocks == 3
    pool.free([block])
    assert pool.num_free_blocks == 4
    assert _free_order(pool) == [0, 1, 3, 2]


def test_freeing_twice_and_overallocating_raise():
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([block])
    with pytest.raises(RuntimeError, match="check num_free_blocks"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_freed_block_stays_cached_until_reallocated():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, _digest(1))
    pool.free([a, b])
    assert pool.get_cached_block(_digest(1)) is a  # still hittable while free
    (reused,) = pool.allocate(1)
    assert reused is a  # a was freed first, so it is the LRU head
    assert a.block_hash is None
    assert pool.get_cached_block(_digest(1)) is None


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache(a, _digest(1))
    pool.cache(b, _digest(1))
    assert pool.get_cached_block(_digest(1)) is a
    assert b.block_hash is None
    pool.free([b, a])
    pool.allocate(1)  # takes b, which has no hash: the index must be untouched
    assert pool.get_cached_block(_digest(1)) is a


def test_caching_disabled_never_hashes():
    pool = BlockPool(1, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache(a, _digest(1))
    assert a.block_hash is None
    assert pool.get_cached_block(_digest(1)) is None


def test_reset_prefix_cache_refused_while_in_use():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.allocate(1)
    pool.cache(a, _digest(1))
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(_digest(1)) is a
    pool.free([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(_digest(1)) is None
    assert a.block_hash is None


def test_zero_blocks_rejected():
    with pytest.raises(ValueError, match="at least 1"):
        BlockPool(0, enable_caching=True)


# --------------------------------------------------------------------------- hashing


def test_hash_chain_depends_on_parent():
    parent_a = hash_block_tokens(None, [1, 2])
    parent_b = hash_block_tokens(None, [1, 3])
    assert hash_block_tokens(parent_a, [5, 6]) != hash_block_tokens(parent_b, [5, 6])
    assert hash_block_tokens(parent_a, [5, 6]) == hash_block_tokens(parent_a, [5, 6])
    assert len(parent_a) == 32


def test_hash_encoding_is_unambiguous():
    assert hash_block_tokens(None, [1], ("ab",)) != hash_block_tokens(None, [1], ("a", "b"))
    assert hash_block_tokens(None, [1], (1,)) != hash_block_tokens(None, [1], ("1",))
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1], (2,))
    # a prompt's embedding digest (bytes) never equals a salt or identifier (str)
    assert hash_block_tokens(None, [0], (b"d",)) != hash_block_tokens(None, [0], ("d",))
    with pytest.raises(TypeError, match="str, int or bytes"):
        hash_block_tokens(None, [1], (1.5,))  # type: ignore[arg-type]


def test_hash_is_stable_across_processes():
    code = (
        "from pagedlm.kv_cache.hashing import hash_block_tokens;"
        "print(hash_block_tokens(None, [1, 2, 3], ('salt',)).hex())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert digests == {hash_block_tokens(None, [1, 2, 3], ("salt",)).hex()}


def test_update_block_hashes_covers_full_blocks_only_and_extends():
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8))
    update_block_hashes(request, block_size=2)
    assert len(request.block_hashes) == 2
    first = list(request.block_hashes)
    request.append_output_token_ids([6])
    update_block_hashes(request, block_size=2)
    assert request.block_hashes[:2] == first
    assert request.block_hashes[2] == hash_block_tokens(first[1], [5, 6])


def test_cache_salt_enters_first_block_and_the_chain():
    plain = Request("a", [1, 2, 3, 4], SamplingParams())
    salted = Request("b", [1, 2, 3, 4], SamplingParams(), cache_salt="tenant-1")
    update_block_hashes(plain, 2)
    update_block_hashes(salted, 2)
    assert plain.block_hashes[0] != salted.block_hashes[0]
    assert plain.block_hashes[1] != salted.block_hashes[1]


def test_a_consecutive_pool_takes_the_free_block_after_the_last_one_taken():
    pool = BlockPool(10, enable_caching=True, consecutive=True)
    blocks = pool.allocate(10)
    pool.free([blocks[i] for i in (8, 5, 0, 4, 1, 3, 2, 9)])  # queue: 8 5 0 4 1 3 2 9
    cached = blocks[3]
    assert pool.cache(cached, _digest(3))
    # 3 and 4 follow block 2 and are free (3 cached): taken first, out of LRU order; 5 is
    # free too; 6 is held, so the head (8) comes next, then 9, which follows it.
    taken = pool.allocate(5, after=2)
    assert [b.block_id for b in taken] == [3, 4, 5, 8, 9]
    assert cached.block_hash is None and pool.get_cached_block(_digest(3)) is None
    assert _free_order(pool) == [0, 1, 2]
    # No block to follow: the head, then the blocks after it.
    assert [b.block_id for b in pool.allocate(2)] == [0, 1]
    # A plain pool ignores ``after``: the LRU head.
    plain = BlockPool(4, enable_caching=True)
    assert [b.block_id for b in plain.allocate(2, after=1)] == [0, 1]
    assert [b.block_id for b in plain.allocate(1, after=0)] == [2]
