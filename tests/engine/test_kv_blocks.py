"""BlockPool (pipeline/engine/kv/blocks.py): blocks lent, shared by prefix, cached, rolled back, returned."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from pipeline.engine.kv.blocks import BlockPool, OutOfBlocks, chain, ROOT


def check_invariants(pool: BlockPool) -> None:
    """Every block is free, cached or held, exactly one of them; its ref count is the tables holding it;
    the key index and its inverse agree."""
    held = Counter(b for t in pool._tables.values() for b in t.blocks)
    free, cached = set(pool._free), set(pool._cached)
    assert len(free) == len(pool._free)
    assert not free & cached and not free & set(held) and not cached & set(held)
    assert free | cached | set(held) == set(range(pool.num_blocks))
    assert all(pool._refs[b] == held.get(b, 0) for b in range(pool.num_blocks))
    assert all(pool._key_of[b] == k for k, b in pool._by_key.items())
    assert all(b in pool._key_of for b in cached)                          # a cached block keeps its key
    assert pool.num_used == len(held)


def test_a_sequence_holds_only_the_blocks_its_length_needs():
    pool = BlockPool(num_blocks=10, block_size=4)
    assert pool.grow("a", 5) == [0, 1]
    assert pool.grow("a", 8) == []                    # still two blocks
    assert pool.grow("a", 9) == [2]
    assert pool.table("a") == [0, 1, 2] and pool.num_used == 3
    check_invariants(pool)


def test_out_of_blocks_takes_nothing():
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.grow("a", 8)
    with pytest.raises(OutOfBlocks, match="3 more blocks of 4 positions needed for 12 positions, 1 of 3 available"):
        pool.grow("b", 12)
    assert not pool.table("b") and pool.num_available == 1
    check_invariants(pool)


def test_rollback_returns_the_blocks_wholly_past_the_new_length():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.grow("a", 13)                                 # blocks 0..3
    assert pool.truncate("a", 9) == [3]                # positions 8 and 9 stay in block 2
    assert pool.table("a") == [0, 1, 2]
    assert pool.truncate("a", 8) == [2]
    check_invariants(pool)


def test_committed_blocks_are_not_rolled_back():
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.grow("a", 10)
    pool.commit("a", list(range(9)))                   # two full blocks committed
    with pytest.raises(ValueError, match="would drop committed blocks"):
        pool.truncate("a", 7)


def test_a_prompt_takes_the_full_blocks_of_its_prefix_by_reference():
    pool = BlockPool(num_blocks=16, block_size=4)
    system = [7] * 10
    pool.grow("a", 14)
    pool.commit("a", system + [1, 2, 3, 4])            # 3 full blocks
    # b shares the first 10 tokens: 2 full blocks of them
    shared = pool.match(system + [5, 6, 7], limit=12)
    assert shared == pool.table("a")[:2]
    pool.share("b", shared)
    pool.grow("b", 13)
    assert pool.table("b")[:2] == shared and pool.table("b")[2] not in pool.table("a")
    assert pool.stats().shared == 2 and pool.stats().prefix_hits == 2
    check_invariants(pool)
    # a limit stops at the blocks it covers
    assert pool.match(system + [1, 2, 3, 4], limit=11) == pool.table("a")[:2]
    assert pool.match(system + [1, 2, 3, 4], limit=12) == pool.table("a")[:3]
    # a different first token shares nothing, though later blocks have equal tokens
    assert pool.match([8] + system[1:] + [1, 2, 3, 4], limit=14) == []


def test_released_full_blocks_are_cached_until_the_pool_needs_them():
    pool = BlockPool(num_blocks=4, block_size=2)
    pool.grow("a", 4)
    pool.commit("a", [1, 2, 3, 4])
    pool.release("a")
    assert pool.stats().cached == 2 and pool.num_available == 4
    assert pool.match([1, 2, 3, 4, 5], limit=4) == [0, 1]
    pool.grow("b", 6)                                   # the two free blocks, then the oldest cached one
    assert pool.match([1, 2, 3, 4, 5], limit=4) == [0]  # the second block was given up first
    check_invariants(pool)
    pool.release("b")
    pool.forget_prefixes()
    assert pool.match([1, 2, 3, 4], limit=4) == [] and pool.stats().free == 4
    check_invariants(pool)


def test_a_shared_block_is_returned_only_when_its_last_holder_releases_it():
    pool = BlockPool(num_blocks=6, block_size=2)
    pool.grow("a", 4)
    pool.commit("a", [1, 2, 3, 4])
    pool.share("b", pool.match([1, 2, 3, 4, 9], limit=4))
    pool.release("a")
    assert pool.stats().used == 2 and pool.stats().cached == 0
    pool.release("b")
    assert pool.stats().used == 0 and pool.stats().cached == 2
    check_invariants(pool)


def test_the_same_prefix_computed_twice_is_indexed_once():
    pool = BlockPool(num_blocks=8, block_size=2)
    for owner in ("a", "b"):                           # admitted together: both compute it
        pool.grow(owner, 4)
        pool.commit(owner, [1, 2, 3, 4])
    assert pool.match([1, 2, 3, 4], limit=4) == pool.table("a")
    pool.release("b")                                  # its copy is not a prefix anyone finds: free
    assert pool.stats().free == 6
    check_invariants(pool)


def test_keys_chain_over_every_earlier_token():
    assert chain(ROOT, [1, 2]) != chain(ROOT, [2, 1])
    assert chain(chain(ROOT, [1, 2]), [3, 4]) != chain(chain(ROOT, [9, 2]), [3, 4])


def test_random_use_keeps_every_block_accounted_for_and_returns_them_all():
    """Random grows, commits, rollbacks, shares and releases (the engine's calls): after each, every
    block is in exactly one state; at the end every block is back (none leaked)."""
    rng = random.Random(0)
    pool = BlockPool(num_blocks=40, block_size=4)
    prompts = [[rng.randrange(3) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    live: dict[int, tuple[list[int], int]] = {}          # owner -> (tokens committed, positions held)
    for step in range(3000):
        owner = rng.randrange(16)
        if owner not in live:
            tokens = list(rng.choice(prompts))
            shared = pool.match(tokens, limit=len(tokens) - 1)
            pool.share(owner, shared)
            live[owner] = (tokens, len(shared) * pool.block_size)
            check_invariants(pool)
            continue
        tokens, held = live[owner]
        action = rng.random()
        if action < 0.5:                               # a round: grow by drafts, commit some, roll back
            drafts = rng.randrange(1, 6)
            try:
                pool.grow(owner, len(tokens) + drafts)
            except OutOfBlocks:
                pool.release(owner)                    # preempted
                del live[owner]
                check_invariants(pool)
                continue
            accepted = rng.randrange(0, drafts + 1)
            tokens = tokens + [rng.randrange(3) for _ in range(accepted)]
            pool.commit(owner, tokens[:-1])              # the last token has no KV yet
            pool.truncate(owner, len(tokens))
            live[owner] = (tokens, len(tokens))
        elif action < 0.6:
            pool.release(owner)
            del live[owner]
        check_invariants(pool)
    for owner in list(live):
        pool.release(owner)
    check_invariants(pool)
    assert pool.num_used == 0 and pool.num_available == pool.num_blocks
    assert pool.prefix_hits > 0 and pool.peak_used > pool.num_blocks // 2
