"""Hybrid models: the reported hit is the longest prefix EVERY group can resume from.

Two baselines show what goes wrong elsewhere:

* ``attention_only_hit``: the full-attention group's own hit, as an engine (or connector,
  LMCache #2845) that restores attention KV without checking the other groups reports it.
  On Mamba hybrids it is a false hit when no state was saved at that position.
* ``single_candidate_hit``: the full-attention hit if every other group can resume exactly
  there, else 0 (what a sliding-window group that keeps only one tail per boundary gives,
  vLLM #57610): a zero hit when the window's last blocks are gone although an earlier
  position is fully resumable.

The allocator's own answer is checked against the shadow model (what each block really
holds, what each family needs) and against the value worked out by hand.
"""

from __future__ import annotations

from runtime_testkit import (
    Shadow,
    chunked,
    context,
    full,
    make_allocator,
    mamba,
    needed_indices,
    sliding,
)

from kvspec_core.runtime import KVCacheAllocator, Request

SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]


def group_hashes(allocator: KVCacheAllocator, request: Request, group: int) -> list[bytes]:
    fine = allocator._hasher.hashes(request, len(request.token_ids) - 1)
    stride = allocator._hash_stride[group]
    return list(fine[stride - 1 :: stride])


def attention_only_hit(allocator: KVCacheAllocator, request: Request, group: int) -> int:
    hashes = group_hashes(allocator, request, group)
    blocks = allocator.rules[group].longest_hit(hashes, allocator._caches[group], len(hashes))
    return len(blocks) * allocator._block_tokens[group]


def single_candidate_hit(allocator: KVCacheAllocator, request: Request, group: int) -> int:
    candidate = attention_only_hit(allocator, request, group)
    for other, spec in enumerate(allocator.specs):
        tokens = allocator._block_tokens[other]
        hashes = group_hashes(allocator, request, other)
        cache = allocator._caches[other]
        for index in needed_indices(spec, tokens, candidate):
            if hashes[index] not in cache:
                return 0
    return candidate


def run(allocator: KVCacheAllocator, shadow: Shadow, request: Request, chunks: list[int]):
    prefix = allocator.find_cached_prefix(request)
    shadow.check_hit(request, prefix)
    sizes = chunks or [len(request.token_ids) - prefix.num_tokens]
    result = allocator.allocate_slots(request, sizes[0], prefix=prefix)
    assert result
    shadow.record(request, result)
    for size in sizes[1:]:
        result = allocator.allocate_slots(request, size)
        assert result
        shadow.record(request, result)
    return prefix


def mamba_hybrid() -> tuple[KVCacheAllocator, Shadow]:
    allocator = make_allocator([full(4), mamba(4)], [64, 16], [0, 1], ctx=context(in_flight=32))
    return allocator, Shadow(allocator)


def test_no_hit_where_no_mamba_state_was_saved() -> None:
    allocator, shadow = mamba_hybrid()
    # One prefill step of 22 tokens: the only Mamba state is the one at 22.
    run(allocator, shadow, Request("a", SHARED + [100, 101]), [])
    later = Request("b", SHARED + [200, 201, 202])
    assert attention_only_hit(allocator, later, 0) == 20  # false: no state at 20
    assert run(allocator, shadow, later, []).num_tokens == 0


def test_hit_at_the_last_saved_mamba_state() -> None:
    allocator, shadow = mamba_hybrid()
    # Prefill in steps of 8 and 14 tokens: a state was saved at 8, none at 20.
    run(allocator, shadow, Request("a", SHARED + [100, 101]), [8, 14])
    later = Request("b", SHARED + [200, 201, 202])
    assert attention_only_hit(allocator, later, 0) == 20
    assert run(allocator, shadow, later, []).num_tokens == 8


def test_hit_at_a_state_saved_while_decoding() -> None:
    allocator, shadow = mamba_hybrid()
    first = Request("a", SHARED[:14])
    run(allocator, shadow, first, [])
    for token in SHARED[14:17]:  # decoding to 16 saves the state at 16
        first.append_token(token)
        result = allocator.allocate_slots(first, 1)
        shadow.record(first, result)
    assert run(allocator, shadow, Request("b", SHARED + [1]), []).num_tokens == 16


def test_sliding_window_whose_last_blocks_were_evicted_resumes_earlier() -> None:
    # Window 8 with blocks of 4: resuming at p needs the blocks of [p - 7, p).
    allocator = make_allocator([sliding(4, 8), full(4)], 19, ctx=context(in_flight=32))
    shadow = Shadow(allocator)
    prompt = list(range(1, 33))
    run(allocator, shadow, Request("a", prompt), [])
    allocator.free("a")  # sliding-window blocks are freed first, last block first
    run(allocator, shadow, Request("c", [500] * 8), [])  # evicts the window's blocks 7, 6
    later = Request("b", prompt + [900])
    assert attention_only_hit(allocator, later, 1) == 32  # false: the window is gone
    assert single_candidate_hit(allocator, later, 1) == 0  # zero: gives up at once
    prefix = run(allocator, shadow, later, [])
    assert prefix.num_tokens == 24
    window_blocks = prefix.block_ids[0]
    assert window_blocks[:4] == (0, 0, 0, 0) and all(window_blocks[4:6])


def test_chunked_local_resumes_at_a_chunk_start_without_earlier_chunks() -> None:
    allocator = make_allocator([chunked(2, 4), full(2)], 40, ctx=context(in_flight=32))
    shadow = Shadow(allocator)
    run(allocator, shadow, Request("a", SHARED[:13]), [])
    prefix = run(allocator, shadow, Request("b", SHARED[:10] + [1, 2]), [])
    assert prefix.num_tokens == 10
    # Chunk [8, 12) needs blocks 4 only; blocks of chunks 0 and 1 are null entries.
    assert prefix.block_ids[0] == (0, 0, 0, 0, prefix.block_ids[0][4])
    assert prefix.block_ids[0][4] and all(prefix.block_ids[1])


def test_three_families_and_three_page_sizes_agree_on_one_position() -> None:
    allocator = make_allocator(
        [full(4), sliding(2, 5), mamba(8)], [64, 16], [0, 0, 1], ctx=context(in_flight=32)
    )
    shadow = Shadow(allocator)
    assert allocator.hash_block_size == 2
    run(allocator, shadow, Request("a", SHARED + [1, 2]), [16, 6])  # state saved at 16
    prefix = run(allocator, shadow, Request("b", SHARED + [3]), [])
    assert prefix.num_tokens == 16
    assert [len(ids) for ids in prefix.block_ids] == [4, 8, 2]


def test_checkpoint_hint_turns_a_zero_hit_into_reuse() -> None:
    """vLLM #45238: with one-step prefills a Mamba hybrid keeps no state inside the shared
    prefix, so every later request resumes from nothing although attention matches. The
    allocator names where the prompt shares cached content; ending a step there saves the
    state, and the requests after it resume from it."""
    allocator, shadow = mamba_hybrid()
    run(allocator, shadow, Request("a", SHARED + [100, 101]), [])
    second = Request("b", SHARED + [200, 201, 202])
    prefix = allocator.find_cached_prefix(second)
    assert (prefix.num_tokens, prefix.checkpoint_at) == (0, 20)
    run(allocator, shadow, second, [20, 3])  # the step ends at the named position
    third = Request("c", SHARED + [300, 301, 302])
    found = run(allocator, shadow, third, [])
    assert found.num_tokens == 20 and found.checkpoint_at is None


def test_no_checkpoint_hint_without_state_groups() -> None:
    allocator = make_allocator([full(4), sliding(4, 8)], 40, ctx=context(in_flight=32))
    shadow = Shadow(allocator)
    run(allocator, shadow, Request("a", SHARED + [1]), [])
    assert allocator.find_cached_prefix(Request("b", SHARED + [2])).checkpoint_at is None
