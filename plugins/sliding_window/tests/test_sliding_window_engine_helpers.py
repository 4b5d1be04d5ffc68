"""SlidingWindowSpec's engine helpers agree with the window's runtime rules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from sliding_window_testkit import swa_fields

from kvspec_core import SizingContext
from kvspec_core.errors import KVSpecError
from kvspec_sliding_window import KpoolTailSpec, SlidingWindowSpec
from kvspec_sliding_window.runtime_rules import SlidingWindowRules


def test_a_query_reads_the_last_window_positions_itself_included() -> None:
    spec = SlidingWindowSpec(**swa_fields(sliding_window=4))
    assert [spec.first_attended_position(p) for p in (0, 2, 3, 4, 10)] == [0, 0, 0, 1, 7]


def test_retained_tokens_below_the_window_are_not_attended() -> None:
    spec = SlidingWindowSpec(**swa_fields(sliding_window=4, extra_retained_tokens=8))
    assert spec.first_attended_position(10) == 7


def test_slot_mapping_refuses_a_block_the_window_freed() -> None:
    spec = SlidingWindowSpec(**swa_fields(block_size=4, sliding_window=4))
    blocks, states = spec.slot_mapping([0, 0, 5], torch.tensor([8, 9, 11]))
    assert blocks.tolist() == [5, 5, 5] and states.tolist() == [0, 1, 3]
    with pytest.raises(KVSpecError, match="position 7 lies in block-table entry 1, the null"):
        spec.slot_mapping([0, 0, 5], torch.tensor([7, 8]))


def test_the_kpool_tail_has_no_per_token_slots() -> None:
    spec = KpoolTailSpec(**swa_fields(sliding_window=4))
    with pytest.raises(KVSpecError, match="addressed by its kernel"):
        spec.slot_mapping([3], torch.tensor([0]))


@given(
    window=st.integers(1, 300),
    extra=st.integers(0, 64),
    block_size=st.sampled_from([1, 4, 16]),
    computed=st.integers(0, 5000),
)
def test_the_allocator_never_frees_what_the_next_step_reads(
    window: int, extra: int, block_size: int, computed: int
) -> None:
    """A step starting at ``computed`` reads from ``first_attended_position(computed)``; the
    rules free only blocks wholly below ``skipped_tokens(computed)`` rounded down to a block."""
    spec = SlidingWindowSpec(
        **swa_fields(sliding_window=window, extra_retained_tokens=extra, block_size=block_size)
    )
    rules = SlidingWindowRules(spec, SizingContext(max_model_len=8192))
    freed_below = rules.skipped_tokens(computed) // block_size * block_size
    assert freed_below <= spec.first_attended_position(computed) <= computed
