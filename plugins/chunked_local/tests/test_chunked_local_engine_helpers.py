"""ChunkedLocalAttentionSpec's engine helpers agree with the chunk's runtime rules."""

from __future__ import annotations

import torch
from chunked_local_testkit import chunked_fields
from hypothesis import given
from hypothesis import strategies as st

from kvspec_chunked_local import ChunkedLocalAttentionSpec
from kvspec_chunked_local.runtime_rules import ChunkedLocalRules
from kvspec_core import SizingContext


def test_a_query_reads_from_its_chunk_start() -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields(attention_chunk_size=32))
    assert [spec.first_attended_position(p) for p in (0, 31, 32, 33, 70)] == [0, 0, 32, 32, 64]


def test_slot_mapping_of_a_chunk_skips_earlier_chunks() -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields(attention_chunk_size=32, block_size=16))
    start = spec.first_attended_position(40)
    blocks, states = spec.slot_mapping([0, 0, 7], torch.arange(start, 41))
    assert set(blocks.tolist()) == {7} and states.tolist() == list(range(9))


@given(
    chunk=st.integers(1, 300),
    block_size=st.sampled_from([1, 4, 16]),
    computed=st.integers(0, 5000),
)
def test_the_allocator_never_frees_what_the_next_step_reads(
    chunk: int, block_size: int, computed: int
) -> None:
    spec = ChunkedLocalAttentionSpec(
        **chunked_fields(attention_chunk_size=chunk, block_size=block_size)
    )
    rules = ChunkedLocalRules(spec, SizingContext(max_model_len=8192))
    freed_below = rules.skipped_tokens(computed) // block_size * block_size
    assert freed_below <= spec.first_attended_position(computed) <= computed
    assert spec.first_attended_position(computed) % chunk == 0
