"""BlockManager: ref counts, the hashed block cache, LRU eviction (no torch)."""

from __future__ import annotations

import pytest

from prefixflow.engine.native.block_manager import BlockManager
from prefixflow.engine.native.sequence import ROOT_HASH_SEED, KVOwner, chain_hash

_ids = iter(range(10**6))


def owner(tokens: list[int], seed: int = ROOT_HASH_SEED) -> KVOwner:
    return KVOwner(seq_id=next(_ids), token_ids=list(tokens), own_start=0, hash_seed=seed)


def run_prefill(bm: BlockManager, o: KVOwner) -> None:
    """Allocate and 'compute' all of the owner's tokens, as the scheduler does."""
    n = o.num_uncomputed_tokens
    assert bm.can_allocate(bm.num_new_blocks(o, n))
    bm.allocate(o, n)
    bm.commit(o, o.num_computed_tokens + n)


def test_allocate_free_and_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_cache=False)
    a = owner(range(10))
    assert bm.num_new_blocks(a, 10) == 3
    run_prefill(bm, a)
    assert len(a.block_table) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.num_new_blocks(a, 2) == 0 and bm.num_new_blocks(a, 3) == 1  # 10 + 3 > 12
    assert not bm.can_allocate(6)
    bm.free(a)
    assert bm.num_used_blocks == 0 and a.block_table == [] and a.num_computed_tokens == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_needs_at_least_one_block():
    with pytest.raises(ValueError, match="num_blocks=0"):
        BlockManager(num_blocks=0, block_size=4)


def test_full_blocks_are_hashed_and_found_by_a_later_owner():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = owner(range(10))
    run_prefill(bm, a)
    assert len(a.block_hashes) == 2  # the third block is partial: not cached
    a_blocks = list(a.block_table)
    b = owner(list(range(8)) + [99, 98, 97])
    hits = bm.lookup(b, max_blocks=10)
    assert hits == a.block_table[:2]
    assert bm.num_reclaimed(hits) == 0  # still held by a: taking them costs no free block
    bm.take_cached(b, hits)
    assert b.num_computed_tokens == 8
    assert [bm.blocks[x].ref_count for x in hits] == [2, 2]
    bm.free(a)
    assert [bm.blocks[x].ref_count for x in hits] == [1, 1]
    # An owner whose own KV starts a block into its prompt (a group's member) chains from that
    # block's hash: it finds the blocks any prompt with the same tokens computed, a's freed ones too.
    member = KVOwner(seq_id=next(_ids), token_ids=list(range(10)), own_start=4, hash_seed=chain_hash([0, 1, 2, 3], 4))
    assert bm.lookup(member, 10) == [a_blocks[1]]
    # The same own tokens after other tokens: another chain.
    c = KVOwner(
        seq_id=next(_ids), token_ids=[9, 1, 2, 3, *range(4, 10)], own_start=4, hash_seed=chain_hash([9, 1, 2, 3], 4)
    )
    assert bm.lookup(c, 10) == []


def test_lookup_stops_at_the_first_miss_and_at_max_blocks():
    bm = BlockManager(num_blocks=16, block_size=2)
    a = owner([1, 2, 3, 4, 5, 6, 7, 8])
    run_prefill(bm, a)
    assert len(bm.lookup(owner([1, 2, 3, 4, 5, 6, 7, 8]), max_blocks=3)) == 3
    assert len(bm.lookup(owner([1, 2, 9, 4, 5, 6]), max_blocks=3)) == 1  # chain breaks at block 1
    assert bm.lookup(owner([1]), max_blocks=3) == []


def test_freed_cached_blocks_are_reused_then_evicted_lru():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = owner([1, 2, 3, 4]), owner([5, 6, 7, 8])
    run_prefill(bm, a)
    run_prefill(bm, b)
    bm.free(a)  # a freed first: its blocks are evicted first
    bm.free(b)
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0
    # Free but cached: found again, and taking them uses free blocks.
    hits = bm.lookup(owner([5, 6, 7, 8, 9]), 2)
    assert len(hits) == 2 and bm.num_reclaimed(hits) == 2
    # Needing 4 blocks: 2 never-cached ones first, then a's (older) cached blocks.
    c = owner(list(range(20, 28)))
    run_prefill(bm, c)
    assert bm.num_evictions == 2
    assert bm.lookup(owner([1, 2, 3, 4]), 2) == []
    assert len(bm.lookup(owner([5, 6, 7, 8, 9]), 2)) == 2


def test_taking_a_free_cached_block_removes_it_from_the_free_list():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = owner([1, 2, 3, 4])
    run_prefill(bm, a)
    bm.free(a)
    b = owner([1, 2, 3, 4, 5])
    hits = bm.lookup(b, 2)
    bm.take_cached(b, hits)
    assert bm.num_free_blocks == 2
    run_prefill(bm, b)  # the fifth token needs one fresh block
    assert bm.num_free_blocks == 1
    assert len(set(b.block_table)) == 3


def test_no_caching_when_disabled():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_cache=False)
    a = owner([1, 2, 3, 4])
    run_prefill(bm, a)
    assert a.block_hashes == [] and bm.lookup(owner([1, 2, 3, 4]), 2) == []


def test_blocks_hashed_ahead_are_found_in_the_same_step_and_forgotten_if_it_fails():
    bm = BlockManager(num_blocks=16, block_size=4)
    first, second = owner(range(10)), owner(list(range(8)) + [50, 51])
    bm.allocate(first, 10)
    bm.hash_ahead(first, 10)  # scheduled, not computed yet: its 2 full blocks hashed
    assert bm.lookup(second, 2) == first.block_table[:2]
    bm.forget_ahead()  # the step raised: that KV was never written
    assert bm.lookup(second, 2) == [] and all(b.hash is None for b in bm.blocks)
    bm.free(first)
    bm.allocate(first, 10)
    bm.hash_ahead(first, 10)
    bm.commit(first, 10)  # the step ran: commit adds nothing, the hashes stay
    bm.commit_ahead()
    bm.forget_ahead()  # a later failure does not touch computed blocks
    assert bm.lookup(second, 2) == first.block_table[:2]
