"""Hypothesis invariants of BlockPool under every eviction order: free counts are
conserved, no block is both free and referenced, the order evicts exactly as documented, and
an evicted block leaves the hash index."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvspec_core.runtime.pool import EVICTION_POLICIES, NULL_BLOCK, BlockPool

NUM_BLOCKS = 9
GROUPS = (0, 1)


class PoolMachine(RuleBasedStateMachine):
    """Drives a pool of two groups with random takes, hits, releases and caching; a plain
    Counter of references held is the model."""

    @initialize(eviction=st.sampled_from(EVICTION_POLICIES))
    def start(self, eviction: str) -> None:
        self.pool = BlockPool(NUM_BLOCKS, GROUPS, eviction=eviction)
        self.eviction = eviction
        self.held: Counter[int] = Counter()
        self.next_digest = 0

    @rule(count=st.integers(0, NUM_BLOCKS))
    def take(self, count: int) -> None:
        if count > self.pool.num_free_blocks:
            return
        cached_before = {
            block: self.pool.cached_hash(block)
            for block in range(1, NUM_BLOCKS)
            if self.pool.is_cached_free(block)
        }
        fresh_before = self.pool.num_free_blocks - len(cached_before)
        blocks = self.pool.take(count)
        assert len(set(blocks)) == count and NULL_BLOCK not in blocks
        evicted = [block for block in blocks if block in cached_before]
        # Uncached free blocks go first; only the rest are evicted from the cache.
        assert len(evicted) == max(0, count - fresh_before)
        for block in evicted:
            assert self.pool.cached_hash(block) is None
            for cache in self.pool.caches.values():
                assert cached_before[block] not in cache and block not in cache.values()
        self.held.update(blocks)

    @rule(data=st.data())
    def hit(self, data: st.DataObject) -> None:
        cached = sorted({block for cache in self.pool.caches.values() for block in cache.values()})
        if not cached:
            return
        blocks = data.draw(st.lists(st.sampled_from(cached), max_size=3, unique=True))
        self.pool.touch(blocks)
        self.held.update(blocks)

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.held:
            return
        blocks = data.draw(st.lists(st.sampled_from(sorted(self.held)), max_size=4, unique=True))
        self.pool.release(blocks)
        self.held.subtract(blocks)
        self.held += Counter()  # drop zero counts

    @rule(data=st.data(), gid=st.sampled_from(GROUPS))
    def cache(self, data: st.DataObject, gid: int) -> None:
        uncached = sorted(block for block in self.held if self.pool.cached_hash(block) is None)
        if not uncached:
            return
        blocks = data.draw(st.lists(st.sampled_from(uncached), max_size=3, unique=True))
        digests = [self.next_digest_bytes() for _ in blocks]
        assert self.pool.cache_blocks(gid, digests, blocks) == len(blocks)

    @rule()
    def reset(self) -> None:
        self.pool.reset_prefix_cache()
        assert self.pool.num_cached_blocks == 0

    def next_digest_bytes(self) -> bytes:
        self.next_digest += 1
        return self.next_digest.to_bytes(32, "little")

    @invariant()
    def counts_are_conserved_and_disjoint(self) -> None:
        pool = self.pool
        assert pool.num_free_blocks + len(self.held) == NUM_BLOCKS - 1
        assert pool.num_used_blocks == len(self.held)
        for block in range(1, NUM_BLOCKS):
            assert pool.ref_counts[block] == self.held[block]
            if self.held[block]:
                assert not pool.is_cached_free(block), f"block {block} is free and held"
        pool.check_invariants()

    @invariant()
    def the_hash_index_names_only_blocks_holding_that_hash(self) -> None:
        for cache in self.pool.caches.values():
            for digest, block in cache.items():
                assert self.pool.cached_hash(block) == digest


PoolMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPoolMachine = PoolMachine.TestCase


def test_lru_evicts_a_requests_tail_first_and_a_hit_leaves_the_order() -> None:
    # vLLM's order: blocks freed together are evicted in the order given (the allocator
    # frees a request's table reversed, tail first); a revived block is no candidate.
    pool = BlockPool(6, eviction="lru")
    first = pool.take(3)
    second = pool.take(2)
    pool.cache_blocks(0, [bytes([i]) * 32 for i in range(5)], first + second)
    pool.release(list(reversed(first)))
    pool.release(list(reversed(second)))
    pool.touch([first[2]])
    assert pool.take(4) == [first[1], first[0], second[1], second[0]]
