"""The admission cap against a brute-force count of the blocks a request really holds.

A request with ``computed`` tokens done and ``in_flight`` more scheduled holds positions from
the start of the chunk holding ``computed`` (earlier chunks are freed once processed) up to
``computed + in_flight``. Positions are spread over ``dcp`` ranks in runs of ``interleave``
tokens; each rank holds the blocks its share of that range falls in.
"""

from __future__ import annotations

from chunked_local_testkit import chunked_fields
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_chunked_local import ChunkedLocalAttentionSpec
from kvspec_core import SizingContext


def worst_rank_blocks(start: int, end: int, dcp: int, block_size: int, interleave: int) -> int:
    touched: list[set[int]] = [set() for _ in range(dcp)]
    for position in range(start, end):
        rank = (position // interleave) % dcp
        local = (position // (interleave * dcp)) * interleave + position % interleave
        touched[rank].add(local // block_size)
    return max(len(blocks) for blocks in touched)


@settings(max_examples=60, deadline=None)
@given(
    chunk=st.integers(1, 40),
    in_flight=st.integers(1, 40),
    max_len=st.integers(1, 150),
    block_size=st.sampled_from([1, 2, 4, 8, 16]),
    dcp=st.integers(1, 4),
    interleave_choice=st.sampled_from(["one", "block"]),
)
def test_cap_covers_every_step_of_every_request(
    chunk: int, in_flight: int, max_len: int, block_size: int, dcp: int, interleave_choice: str
) -> None:
    interleave = 1 if interleave_choice == "one" else block_size
    spec = ChunkedLocalAttentionSpec(
        **chunked_fields(attention_chunk_size=chunk, block_size=block_size)
    )
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight, dcp_size=dcp)
    cap = spec.max_blocks_per_request(ctx)
    for computed in range(0, max_len):
        scheduled = min(in_flight, max_len - computed)
        first_held = computed // chunk * chunk
        held = worst_rank_blocks(first_held, computed + scheduled, dcp, block_size, interleave)
        assert held <= cap, (computed, scheduled, held, cap)


def test_aligned_chunks_are_sized_exactly_as_the_reference() -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields(attention_chunk_size=32, block_size=16))
    ctx = SizingContext(max_model_len=1000, max_in_flight_tokens=16)
    # Computed 63, 16 in flight: positions 32..78 -> blocks 2, 3, 4 = cdiv(48, 16).
    assert worst_rank_blocks(32, 79, 1, 16, 1) == 3 == spec.max_blocks_per_request(ctx)
