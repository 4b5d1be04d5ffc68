"""A block a request computes again while its hash is cached (a hybrid's common hit stops
before a group's own: the sliding window or Mamba has no block there, full attention
recomputes cached blocks) becomes the cached copy, as in vLLM, where every copy stays
findable until the newest is evicted. Keeping the first copy instead let a prefix die with
its oldest copy: on the benchmark trace's sliding-window hybrid, 6.6% fewer hit tokens
than vLLM 0.33 on a tight pool."""

from __future__ import annotations

import pytest
from runtime_testkit import context, full, make_allocator, manager_with_families, sliding

from kvspec_core import SizingContext
from kvspec_core.runtime import BlockPool, KVCacheAllocator, Request, chat_trace, simulate, trace


def digest(index: int) -> bytes:
    return index.to_bytes(32, "little")


def test_an_old_copy_in_use_leaves_the_cache_and_is_freed_uncached() -> None:
    pool = BlockPool(6)
    old, new, other = pool.take(3)
    pool.cache_blocks(0, [digest(1), digest(2)], [old, other])
    pool.release([other])
    assert pool.cache_blocks(0, [digest(1)], [new]) == 1
    assert pool.caches[0] == {digest(1): new, digest(2): other}
    pool.release([old])  # its request ends: a plain free block now, reused first
    assert not pool.is_cached_free(old)
    assert pool.take(3)[-1] == old and pool.caches[0] == {digest(1): new, digest(2): other}
    pool.check_invariants()


def test_segmented_newer_copy_of_a_reused_block_stays_protected() -> None:
    pool = BlockPool(6, eviction="segmented")
    old, new, once = pool.take(3)
    pool.cache_blocks(0, [digest(1), digest(2)], [old, once])
    pool.touch([old])  # a hit reused it
    pool.release([old, old, once])
    pool.cache_blocks(0, [digest(1)], [new])
    pool.release([new])
    pool.check_invariants()
    # The two never-cached blocks and the old copy go first, then the never-reused block;
    # the newer copy of the reused prefix goes last.
    assert pool.take(4)[-1] == once
    assert pool.caches[0] == {digest(1): new}
    pool.check_invariants()


def test_sliding_window_hybrid_recomputed_full_attention_blocks_become_the_cached_copies() -> None:
    allocator = make_allocator(
        [full(16), sliding(16, 32)], 31, ctx=context(max_model_len=256, in_flight=256)
    )
    first = Request("a", list(range(97)))
    assert allocator.allocate_slots(first, 97)
    first.append_token(500)
    assert allocator.allocate_slots(first, 1)  # the window leaves sliding blocks 0-3 (cached)
    # Take every free block: the four cached sliding-window blocks are evicted.
    filler = Request("d", list(range(1000, 1160)))
    assert allocator.allocate_slots(filler, 160)
    assert allocator.usage.free_blocks == 0
    allocator.free("d")
    # Full attention still caches blocks 0-3 (request a holds them); the window does not,
    # so the hit is 0 and full attention computes those four blocks again.
    second = Request("b", list(range(64)) + [999])
    prefix = allocator.find_cached_prefix(second)
    assert prefix.num_tokens == 0
    assert allocator.allocate_slots(second, 65, prefix=prefix)
    old_copies = allocator.block_ids("a")[0][:4]
    new_copies = allocator.block_ids("b")[0][:4]
    third = Request("c", list(range(64)) + [999])
    found = allocator.find_cached_prefix(third)
    assert found.num_tokens == 64
    assert found.block_ids[0] == new_copies
    allocator.free("a")
    pool = allocator.pools[0]
    # Request a's copies no longer hold a prefix: they are reused before any cached block,
    # while the prefix lives on in request b's blocks.
    assert not any(pool.is_cached_free(block) for block in old_copies)
    assert allocator.find_cached_prefix(third).block_ids[0] == new_copies
    allocator.check_invariants()


#: Hit tokens of vLLM 0.33's KVCacheManager on these reduced traces (benchmarks/vs_vllm.py's
#: ``replay_vllm``, same events, same model: block 16, sliding window 4096 + full attention
#: in one pool of 7,000 blocks, max_model_len 8192). Keeping a hash's first copy got
#: 239,952 and 512,576.
VLLM_HITS = {"shared": 276_736, "chat": 519_344}


@pytest.mark.parametrize("trace_name", sorted(VLLM_HITS))
def test_sliding_window_hybrid_hits_at_least_vllm_on_reduced_traces(trace_name: str) -> None:
    if trace_name == "shared":
        events = trace.make_trace(seed=1, num_requests=300, max_running=16, num_prefixes=8)
    else:
        events = chat_trace.make_trace(seed=1, num_requests=600, max_running=16)
    allocator = KVCacheAllocator(
        [full(16), sliding(16, 4096)],
        7000,
        SizingContext(max_model_len=8192),
        manager=manager_with_families(),
    )
    report = simulate(allocator, list(events))
    allocator.check_invariants()
    assert report.hit_tokens >= VLLM_HITS[trace_name]
