"""AttentionSpec's engine helpers: the keys a query reads and where a token lives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvspec_core import FullAttentionSpec
from kvspec_core.errors import KVSpecError


def full(**fields: object) -> FullAttentionSpec:
    base = {"block_size": 16, "num_kv_heads": 2, "head_size": 8, "dtype": torch.float32}
    return FullAttentionSpec(**{**base, **fields})  # type: ignore[arg-type]


def test_full_attention_reads_from_the_first_token() -> None:
    spec = full()
    assert [spec.first_attended_position(p) for p in (0, 1, 15, 16, 1000)] == [0] * 5


def test_full_attention_recording_a_window_or_chunk_reads_locally() -> None:
    windowed = full(sliding_window=4)
    assert [windowed.first_attended_position(p) for p in (0, 3, 4, 10)] == [0, 0, 1, 7]
    chunked = full(attention_chunk_size=8)
    assert [chunked.first_attended_position(p) for p in (0, 7, 8, 17)] == [0, 0, 8, 16]


@pytest.mark.parametrize("position", [-1, 1.0, True, "3"])
def test_first_attended_position_refuses_non_positions(position: object) -> None:
    with pytest.raises(KVSpecError, match=r"position=.* must be an int >= 0"):
        full().first_attended_position(position)  # type: ignore[arg-type]


def test_slot_mapping_names_block_and_offset() -> None:
    spec = full(block_size=4)
    blocks, states = spec.slot_mapping([7, 3, 9], torch.tensor([0, 3, 4, 9, 11]))
    assert blocks.tolist() == [7, 7, 3, 9, 9]
    assert states.tolist() == [0, 3, 0, 1, 3]


def test_slot_mapping_of_a_compressed_cache_counts_states() -> None:
    spec = full(block_size=8, tokens_per_state=4)
    blocks, states = spec.slot_mapping([5, 6], torch.tensor([0, 3, 4, 8, 15]))
    assert blocks.tolist() == [5, 5, 5, 6, 6]
    assert states.tolist() == [0, 0, 1, 0, 1]


def test_slot_mapping_refuses_null_entries_and_positions_past_the_table() -> None:
    spec = full(block_size=4)
    with pytest.raises(KVSpecError, match="position 2 lies in block-table entry 0, the null"):
        spec.slot_mapping([0, 3], torch.tensor([2, 5]))
    with pytest.raises(KVSpecError, match=r"positions 0\.\.8 are outside a block table of 2"):
        spec.slot_mapping([1, 3], torch.tensor([0, 8]))
    with pytest.raises(KVSpecError, match="1-D integer tensor"):
        spec.slot_mapping([1], torch.tensor([0.0]))
    with pytest.raises(KVSpecError, match="several states per token"):
        from fractions import Fraction

        full(tokens_per_state=Fraction(1, 2)).slot_mapping([1], torch.tensor([0]))


def test_slot_mapping_of_nothing_is_empty() -> None:
    blocks, states = full().slot_mapping([], torch.tensor([], dtype=torch.int64))
    assert blocks.numel() == states.numel() == 0


@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    table=st.lists(st.integers(1, 1000), min_size=1, max_size=12, unique=True),
)
def test_slot_mapping_gives_every_token_its_own_cell(block_size: int, table: list[int]) -> None:
    spec = full(block_size=block_size)
    positions = torch.arange(len(table) * block_size)
    blocks, states = spec.slot_mapping(table, positions)
    cells = set(zip(blocks.tolist(), states.tolist(), strict=True))
    assert len(cells) == positions.numel()
    assert all(0 <= state < spec.num_states for state in states.tolist())
    assert blocks.tolist() == [table[p // block_size] for p in positions.tolist()]


@given(
    position=st.integers(0, 10_000),
    window=st.one_of(st.none(), st.integers(1, 512)),
)
def test_first_attended_position_is_monotone_and_never_past_the_query(
    position: int, window: int | None
) -> None:
    spec = full(sliding_window=window)
    start = spec.first_attended_position(position)
    assert 0 <= start <= position
    assert spec.first_attended_position(position + 1) >= start
