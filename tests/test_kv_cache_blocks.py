"""hyper_gen.kv_cache's pieces on their own: BlockPool (refcounts, free queue, LRU of cached
blocks), the block hash chain and prefix lookup (the one-token rule), state snapshot slots and
budget sizing. Pure host bookkeeping: no framework is imported, the whole file runs in well
under a second."""

import sys

import numpy as np
import pytest

from hyper_gen.kv_cache import (
    BlockPool,
    NotEnoughBlocks,
    PrefixCache,
    SnapshotPool,
    blocks_for_bytes,
    hash_block,
    kv_bytes_per_block,
    snapshot_slots_for_bytes,
)
from hyper_gen.kv_cache.prefix import ROOT_HASH


def _states(pool):
    free, cached = pool.free_blocks(), pool.cached_blocks()
    used = [b for b in range(pool.num_blocks) if pool.refcount(b) > 0]
    assert len(set(free)) == len(free) and len(set(cached)) == len(cached)
    assert not (set(free) & set(cached)) and not (set(free) & set(used)) and not (set(cached) & set(used))
    assert len(free) + len(cached) + len(used) == pool.num_blocks
    assert pool.num_used == len(used)
    return free, cached, used


def test_the_package_imports_no_framework():
    import subprocess

    code = "import sys, hyper_gen.kv_cache; print(sorted({'torch', 'mindspore', 'transformers'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# -- BlockPool -----------------------------------------------------------------------------------


def test_allocate_hands_out_free_blocks_first_in_queue_order():
    pool = BlockPool(4, 16)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.refcount(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.free_blocks() == [3]
    pool.free([2, 0])
    assert pool.free_blocks() == [3, 2, 0]  # uncached blocks rejoin the queue's end
    assert pool.allocate(2) == [3, 2]
    _states(pool)


def test_cached_blocks_are_evicted_only_when_the_free_queue_is_empty_oldest_first():
    evicted = []
    pool = BlockPool(5, 4, on_evict=lambda block, h: evicted.append((block, h)))
    a = pool.allocate(3)
    for block, h in zip(a, ["h0", "h1", "h2"]):
        assert pool.cache(block, h) == block
    pool.free(reversed(a))  # a table frees tail first: its last block is the oldest idle one
    assert pool.cached_blocks() == [2, 1, 0] and pool.num_cached == 3
    assert pool.allocate(2) == [3, 4]  # the free queue first: nothing cached is lost
    assert evicted == [] and pool.evictions == 0
    assert pool.allocate(2) == [2, 1]  # then the oldest cached, hash dropped
    assert evicted == [(2, "h2"), (1, "h1")] and pool.evictions == 2
    assert pool.lookup("h2") is None and pool.lookup("h0") == 0
    assert pool.block_hash(2) is None
    _states(pool)


def test_a_cache_hit_touch_moves_a_block_out_of_the_lru_and_refreshes_it():
    pool = BlockPool(3, 4)
    blocks = pool.allocate(3)
    for block in blocks:
        pool.cache(block, f"h{block}")
    pool.free(blocks)
    assert pool.cached_blocks() == [0, 1, 2]
    pool.touch([0])  # a hit on the oldest
    assert pool.refcount(0) == 1 and pool.cached_blocks() == [1, 2] and pool.num_available == 2
    pool.free([0])
    assert pool.cached_blocks() == [1, 2, 0]  # now the youngest
    assert pool.allocate(1) == [1]
    _states(pool)


def test_refcounts_of_a_block_shared_by_several_tables():
    pool = BlockPool(2, 4)
    (block,) = pool.allocate(1)
    pool.touch([block, block])  # two more holders: a fork and a prefix hit
    assert pool.refcount(block) == 3
    pool.free([block])
    pool.free([block])
    assert pool.refcount(block) == 1 and pool.num_used == 1 and block not in pool.free_blocks()
    pool.free([block])
    assert pool.refcount(block) == 0 and pool.free_blocks() == [1, block]
    _states(pool)


def test_not_enough_blocks_names_the_counts_and_takes_nothing():
    pool = BlockPool(4, 16)
    pool.allocate(3)
    with pytest.raises(NotEnoughBlocks, match="2 blocks needed, 1 available .* of 4") as info:
        pool.allocate(2)
    assert (info.value.needed, info.value.available, info.value.total) == (2, 1, 4)
    assert pool.num_free == 1 and pool.num_used == 3
    assert pool.allocate(0) == []


def test_double_free_and_touching_a_free_block_raise_before_changing_anything():
    pool = BlockPool(3, 4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(ValueError, match=f"block {a} freed more times"):
        pool.free([b, a])
    assert pool.refcount(b) == 1  # b was not released by the refused call
    with pytest.raises(ValueError, match=f"block {b} freed more times"):
        pool.free([b, b])
    with pytest.raises(ValueError, match=f"block {a} is free"):
        pool.touch([b, a])
    assert pool.refcount(b) == 1
    with pytest.raises(ValueError, match="block must be < num_blocks \\(3\\), got 7"):
        pool.free([7])
    with pytest.raises(ValueError, match="block must be >= 0, got -1"):
        pool.touch([-1])


def test_cached_hashes_stay_unique_when_two_blocks_compute_the_same_content():
    pool = BlockPool(3, 4)
    a, b = pool.allocate(2)
    assert pool.cache(a, "same") == a
    assert pool.cache(b, "same") == a  # a stays canonical; b is not registered
    assert pool.block_hash(b) is None and pool.lookup("same") == a
    assert pool.cache(a, "same") == a  # idempotent
    with pytest.raises(ValueError, match="already cached with another hash"):
        pool.cache(a, "other")
    pool.free([b, a])
    assert pool.free_blocks() == [2, b] and pool.cached_blocks() == [a]
    with pytest.raises(ValueError, match="not in use"):
        pool.cache(a, "late")
    _states(pool)


def test_drop_hashes_turns_every_cached_block_free():
    pool = BlockPool(3, 4)
    a, b, c = pool.allocate(3)
    for block in (a, b, c):
        pool.cache(block, f"h{block}")
    pool.free([c, b])
    assert pool.drop_hashes() == 3
    assert pool.num_cached == 0 and pool.free_blocks() == [c, b] and pool.lookup("h0") is None
    assert pool.block_hash(a) is None  # still used, no longer shareable
    pool.free([a])
    assert pool.free_blocks() == [c, b, a] and pool.evictions == 0
    _states(pool)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"num_blocks": 0, "block_size": 16}, ValueError, "num_blocks must be >= 1, got 0"),
        ({"num_blocks": -3, "block_size": 16}, ValueError, "num_blocks must be >= 1, got -3"),
        ({"num_blocks": 4, "block_size": 0}, ValueError, "block_size must be >= 1, got 0"),
        ({"num_blocks": True, "block_size": 16}, TypeError, "num_blocks must be an int, got True"),
        ({"num_blocks": 4, "block_size": 2.0}, TypeError, "block_size must be an int, got 2.0"),
    ],
)
def test_bad_pool_sizes_name_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        BlockPool(**kwargs)


def test_numpy_integers_are_counts():
    pool = BlockPool(np.int64(3), np.int32(4))
    assert pool.allocate(np.int64(2)) == [0, 1]
    with pytest.raises(ValueError, match="n must be >= 0, got -1"):
        pool.allocate(-1)


# -- the hash chain --------------------------------------------------------------------------------


def test_a_block_hash_depends_on_its_parent_tokens_and_extra_key():
    tokens = [5, 6, 7, 8]
    first = hash_block(None, tokens)
    assert first == hash_block(ROOT_HASH, np.array(tokens, dtype=np.int32))  # dtype does not matter
    assert first == hash_block(None, tokens) and len(first) == 32
    assert hash_block(first, tokens) != first  # same tokens, one block deeper
    assert hash_block(hash_block(None, [1, 2, 3, 4]), tokens) != hash_block(hash_block(None, [1, 2, 3, 9]), tokens)
    assert hash_block(None, tokens, extra_key="lora-a") != first
    assert hash_block(None, tokens, extra_key=("weights", 2)) != hash_block(None, tokens, extra_key=("weights", 3))
    assert hash_block(None, [5, 6, 7, 9]) != first
    with pytest.raises(TypeError, match="extra_key must be None, str, bytes, int"):
        hash_block(None, tokens, extra_key=object())


def test_block_hashes_are_deterministic_across_processes():
    """sha256, not the per-process salted hash(): tensor-parallel ranks agree on every hash."""
    import subprocess

    code = "from hyper_gen.kv_cache import hash_block; print(hash_block(None, [1, 2, 3], extra_key='v1').hex())"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""}
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {hash_block(None, [1, 2, 3], extra_key="v1").hex()}


def _cached_prompt(cache, tokens):
    """Allocate and cache every full block of ``tokens`` (as a finished request would)."""
    pool = cache.pool
    hashes = cache.block_hashes(tokens)
    blocks = pool.allocate(len(hashes))
    for block, h in zip(blocks, hashes):
        pool.cache(block, h)
    pool.free(reversed(blocks))
    return blocks


def test_the_same_tokens_after_another_prefix_or_at_another_position_do_not_hit():
    cache = PrefixCache(BlockPool(16, 4))
    blocks = _cached_prompt(cache, list(range(12)))  # blocks [0..3] [4..7] [8..11]
    assert cache.find_longest_prefix(list(range(12)) + [99]) == blocks
    assert cache.find_longest_prefix([0, 1, 2, 3, 4, 5, 6, 7, 50, 51, 52, 53, 1]) == blocks[:2]
    assert cache.find_longest_prefix([4, 5, 6, 7, 0, 1, 2, 3, 8, 9, 10, 11, 1]) == []  # shifted by a block
    assert cache.find_longest_prefix([9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == []  # shifted by one
    assert cache.find_longest_prefix([0, 1, 2, 9, 4, 5, 6, 7, 8, 9, 10, 11, 12]) == []  # a miss ends the chain


def test_at_least_one_token_is_recomputed():
    cache = PrefixCache(BlockPool(16, 4))
    blocks = _cached_prompt(cache, list(range(8)))
    assert cache.find_longest_prefix(list(range(8))) == blocks[:1]  # whole prompt cached: last block recomputed
    assert cache.find_longest_prefix(list(range(9))) == blocks
    assert cache.find_longest_prefix(list(range(4))) == []
    assert cache.find_longest_prefix([0]) == [] and cache.find_longest_prefix([]) == []
    assert [cache.max_hit_blocks(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 0, 0, 1, 1, 2]


def test_usable_cuts_the_hit_back_and_extra_key_reset_drops_everything():
    cache = PrefixCache(BlockPool(16, 4), extra_key="v1")
    blocks = _cached_prompt(cache, list(range(16)))
    tokens = list(range(17))
    assert cache.find_longest_prefix(tokens, usable=lambda n, last: n % 2 == 0) == blocks[:4]
    assert cache.find_longest_prefix(tokens, usable=lambda n, last: last == blocks[1]) == blocks[:2]
    assert cache.find_longest_prefix(tokens, usable=lambda n, last: False) == []
    assert cache.reset(extra_key="v2") == 4
    assert cache.find_longest_prefix(tokens) == [] and cache.pool.num_cached == 0
    assert cache.block_hashes(list(range(4))) != PrefixCache(BlockPool(1, 4), extra_key="v1").block_hashes(range(4))


def test_block_hashes_extend_a_known_chain():
    cache = PrefixCache(BlockPool(4, 4))
    whole = cache.block_hashes(list(range(14)))
    assert len(whole) == 3
    assert cache.block_hashes(list(range(14)), known=whole[:1]) == whole
    with pytest.raises(ValueError, match="known holds 3 hashes but tokens has only 1 full blocks"):
        cache.block_hashes(list(range(5)), known=whole)


@pytest.mark.parametrize(
    "tokens, error, message",
    [
        ("abc", TypeError, "tokens must be a sequence of int token ids"),
        ([1.5, 2.0], TypeError, "must hold int token ids, got dtype float64"),
        ([[1, 2], [3, 4]], ValueError, "must be 1-D"),
        ([3, -1], ValueError, "negative token id: -1"),
    ],
)
def test_bad_token_ids_are_named(tokens, error, message):
    with pytest.raises(error, match=message):
        PrefixCache(BlockPool(4, 4)).block_hashes(tokens)


# -- state snapshots -------------------------------------------------------------------------------


def test_snapshot_boundaries_every_k_blocks():
    pool = SnapshotPool(2, every_blocks=2)
    assert [n for n in range(9) if pool.is_boundary(n)] == [2, 4, 6, 8]
    assert pool.boundaries(0, 16, 4) == [8, 16]
    assert pool.boundaries(8, 15, 4) == []  # position 16 not computed yet
    assert pool.boundaries(7, 8, 4) == [8]
    assert pool.boundaries(0, 7, 4) == []


def test_snapshot_slots_are_owned_by_one_block_each():
    pool = SnapshotPool(2, every_blocks=1)
    assert pool.attach(10) == 0 and pool.attach(11) == 1
    assert pool.attach(12) is None  # all held
    with pytest.raises(ValueError, match="block 10 already owns snapshot slot 0"):
        pool.attach(10)
    assert pool.release(10) == 0 and pool.release(10) is None
    assert pool.attach(12) == 0 and pool.owners() == {11: 1, 12: 0}
    assert pool.clear() == 2 and pool.num_free == 2 and pool.num_used == 0
    with pytest.raises(ValueError, match="state_snapshot_blocks must be >= 1, got 0"):
        SnapshotPool(2, every_blocks=0)
    with pytest.raises(ValueError, match="num_snapshot_slots must be >= 0, got -1"):
        SnapshotPool(-1, every_blocks=1)


# -- memory budget ---------------------------------------------------------------------------------


def test_blocks_for_bytes_and_the_budget_that_cannot_hold_one():
    per_block = kv_bytes_per_block(16, num_attention_layers=2, num_kv_heads=4, head_dim=8, itemsize=4)
    assert per_block == 2 * 2 * 4 * 8 * 16 * 4 == 8192
    assert blocks_for_bytes(8192 * 10 + 8191, per_block) == 10
    assert blocks_for_bytes(8192, per_block) == 1
    with pytest.raises(ValueError, match="cache_memory_bytes=8191 cannot hold one KV cache block \\(8192 bytes\\)"):
        blocks_for_bytes(8191, per_block)
    with pytest.raises(ValueError, match="cache_memory_bytes must be >= 0, got -5"):
        blocks_for_bytes(-5, per_block)
    with pytest.raises(TypeError, match="cache_memory_bytes must be an int, got 1.5"):
        blocks_for_bytes(1.5, per_block)
    with pytest.raises(ValueError, match="bytes_per_block must be >= 1, got 0"):
        blocks_for_bytes(100, 0)
    assert snapshot_slots_for_bytes(10_000, 3_000) == 3 and snapshot_slots_for_bytes(0, 3_000) == 0
