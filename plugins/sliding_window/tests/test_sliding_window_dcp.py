"""Sliding window under decode context parallelism, checked by counting blocks rank by rank.

DCP interleaves token positions across ranks one by one: position ``p`` lives on rank
``p % dcp`` at local index ``p // dcp``. A request holds a contiguous range of positions (the
window plus in-flight tokens); each rank's blocks are its local indices divided by the block
size. The admission cap must cover the worst rank for every placement of that range.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from sliding_window_testkit import swa_fields

from kvspec_core import SizingContext
from kvspec_core.arithmetic import cdiv
from kvspec_sliding_window import SlidingWindowSpec


def blocks_per_rank(
    start: int, num_tokens: int, dcp: int, block_size: int, interleave: int = 1
) -> list[int]:
    """Distinct blocks each rank touches holding positions ``[start, start + num_tokens)``."""
    touched: list[set[int]] = [set() for _ in range(dcp)]
    for position in range(start, start + num_tokens):
        rank = (position // interleave) % dcp
        local = (position // (interleave * dcp)) * interleave + position % interleave
        touched[rank].add(local // block_size)
    return [len(blocks) for blocks in touched]


def tokens_per_rank(start: int, num_tokens: int, dcp: int) -> list[int]:
    counts = [0] * dcp
    for position in range(start, start + num_tokens):
        counts[position % dcp] += 1
    return counts


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 48),
    in_flight=st.integers(1, 48),
    max_len=st.integers(1, 160),
    block_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
    dcp=st.integers(1, 5),
    interleave_choice=st.sampled_from(["one", "two", "block"]),
)
def test_cap_covers_every_rank_for_every_placement(
    window: int, in_flight: int, max_len: int, block_size: int, dcp: int, interleave_choice: str
) -> None:
    interleave = {"one": 1, "two": 2 if block_size % 2 == 0 else 1, "block": block_size}[
        interleave_choice
    ]
    spec = SlidingWindowSpec(**swa_fields(sliding_window=window, block_size=block_size))
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight, dcp_size=dcp)
    held = spec.retained_tokens(ctx)
    cap = spec.max_blocks_per_request(ctx)
    worst = 0
    for start in range(0, max_len - held + 1):
        if interleave == 1:
            assert max(tokens_per_rank(start, held, dcp)) <= cdiv(held, dcp)
        worst = max(worst, *blocks_per_rank(start, held, dcp, block_size, interleave))
    assert worst <= cap
    # The bound is the reference's +1 argument applied per rank: never more than one block
    # of slack over the worst placement actually seen.
    assert cap - worst <= 1


def test_worked_example_four_ranks() -> None:
    # window 8 + 8 in flight - 1 = 15 positions; 4 ranks hold at most 4 each; blocks of 2.
    spec = SlidingWindowSpec(**swa_fields(sliding_window=8, block_size=2))
    ctx = SizingContext(max_model_len=1000, max_in_flight_tokens=8, dcp_size=4)
    assert spec.retained_tokens(ctx) == 15
    assert spec.max_blocks_per_request(ctx) == cdiv(cdiv(15, 4), 2) + 1 == 3
    # Positions 2..16 put 4 positions on ranks 2 and 3, local indices 0..3 -> blocks {0, 1};
    # positions 6..20 put local indices 1..4 on rank 2 -> blocks {0, 1, 2}: the cap is reached.
    assert blocks_per_rank(6, 15, 4, 2)[2] == 3
    assert max(blocks_per_rank(start, 15, 4, 2)[r] for start in range(900) for r in range(4)) == 3


def test_without_sharding_every_rank_holds_the_whole_window() -> None:
    sharded = SlidingWindowSpec(**swa_fields(sliding_window=8, block_size=2))
    replicated = SlidingWindowSpec(**swa_fields(sliding_window=8, block_size=2, dcp_sharded=False))
    ctx = SizingContext(max_model_len=1000, max_in_flight_tokens=8, dcp_size=4)
    assert replicated.max_blocks_per_request(ctx) == cdiv(15, 2) + 1 == 9
    assert sharded.max_blocks_per_request(ctx) < replicated.max_blocks_per_request(ctx)
