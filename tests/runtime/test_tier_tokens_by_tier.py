"""Hit tokens per tier (``TierLookup._tokens_by_tier``): whole-list forms against the
position-by-position definition (each hash block counts for the slowest tier any group
takes its content from; a null entry counts for the tier of the group's next block)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core.runtime.tier_lookup import TierLookup, _loads_of


def by_position(hit, found, block_tokens, hash_block_size, count):
    slowest = [0] * (hit // hash_block_size)
    for gid, ids in found.items():
        stride = block_tokens[gid] // hash_block_size
        tier = 0
        for index in range(len(ids) - 1, -1, -1):
            block = ids[index]
            if block:
                tier = 0 if block > 0 else (-block - 1) % count + 1
            for fine in range(index * stride, min((index + 1) * stride, len(slowest))):
                slowest[fine] = max(slowest[fine], tier)
    totals = [0] * (count + 1)
    for tier in slowest:
        totals[tier] += hash_block_size
    return tuple(totals)


@st.composite
def hits(draw):
    count = draw(st.integers(1, 3))
    hash_block_size = 16
    groups = draw(st.integers(1, 3))
    strides = [draw(st.sampled_from([1, 1, 2, 4])) for _ in range(groups)]
    hit_blocks = draw(st.integers(1, 40))
    hit = hit_blocks * hash_block_size
    entry = st.one_of(
        st.integers(1, 1000),  # a device block
        st.just(0),  # a null entry
        st.tuples(st.integers(1, 500), st.integers(1, count)).map(
            lambda pair: -(pair[0] * count + pair[1])  # slot, tier: continued_run's code
        ),
    )
    found = {}
    for gid, stride in enumerate(strides):
        if draw(st.booleans()) or not found:
            # As an allocator's hit table: one entry per whole block of the hit.
            length = hit_blocks // stride
            found[gid] = draw(st.lists(entry, min_size=length, max_size=length))
    return hit, found, [stride * hash_block_size for stride in strides], hash_block_size, count


@settings(max_examples=500, deadline=None)
@given(hits())
def test_tokens_by_tier_is_the_position_by_position_count(case) -> None:
    hit, found, block_tokens, hash_block_size, count = case
    loads = [_loads_of(found.get(gid, ()), count) for gid in range(len(block_tokens))]
    expected = by_position(hit, found, block_tokens, hash_block_size, count)
    assert TierLookup._tokens_by_tier(*case, loads) == expected
