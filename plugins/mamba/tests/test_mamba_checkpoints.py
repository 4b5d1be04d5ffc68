"""Prefill checkpoint position and validity, as the reference computes them, with refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, KVSpecError
from kvspec_mamba import is_prefill_checkpoint_valid, prefill_checkpoint_position


@pytest.mark.parametrize(
    "num_tokens, hash_block, drop_eagle, position",
    [
        (100, 16, False, 96),  # last boundary before token 99
        (96, 16, False, 80),  # token 95 is still being produced: boundary 80, not 96
        (97, 16, False, 96),
        (100, 16, True, 80),  # EAGLE shifts one hash block back
        (10, 16, True, 0),  # never below 0
        (1, 16, False, 0),
        (0, 16, False, 0),
        (1000, 1, False, 999),
    ],
)
def test_checkpoint_position(
    num_tokens: int, hash_block: int, drop_eagle: bool, position: int
) -> None:
    assert prefill_checkpoint_position(num_tokens, hash_block, drop_eagle) == position


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((-1, 16, False), InvalidFieldError, "num_tokens=-1"),
        ((100, 0, False), InvalidFieldError, "hash_block_size=0"),
        ((100, 16, "yes"), InvalidFieldTypeError, "drop_eagle_block"),
        ((100.0, 16, False), InvalidFieldTypeError, "num_tokens"),
    ],
)
def test_checkpoint_position_refuses_bad_input(
    args: tuple, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        prefill_checkpoint_position(*args)


# (query_start, query_end, checkpoint, hash_block, mamba_block, alignment, valid)
VALIDITY_CASES = [
    (0, 100, 96, 16, 16, 16, True),
    (0, 100, 96, 16, 16, None, False),  # backend exports no mid-query checkpoints
    (0, 100, 96, 16, 16, 64, False),  # 96 is not a multiple of 64 from the start
    (0, 100, 96, 16, 16, 32, True),
    (32, 100, 96, 32, 16, 64, True),
    (16, 100, 96, 32, 16, 16, False),  # query does not start on a hash block boundary
    (80, 100, 90, 16, 16, 10, False),  # checkpoint less than a hash block after start
    (0, 96, 96, 16, 16, 16, False),  # checkpoint must lie strictly inside the query
    (96, 100, 98, 2, 16, 2, False),  # query writes no column past its initial state
    (0, 40, 32, 16, 16, 16, True),
    (0, 33, 32, 16, 16, 16, True),  # checkpoint column cdiv(33,16)-2 = 1 > -1
    (0, 32, 16, 16, 16, 16, True),
    (16, 40, 32, 16, 64, 16, False),  # only the column rule fails: cdiv(40,64)-2 < 15//64
]


@pytest.mark.parametrize(
    "start, end, checkpoint, hash_block, mamba_block, alignment, valid", VALIDITY_CASES
)
def test_checkpoint_validity(
    start: int,
    end: int,
    checkpoint: int,
    hash_block: int,
    mamba_block: int,
    alignment: int | None,
    valid: bool,
) -> None:
    assert (
        is_prefill_checkpoint_valid(start, end, checkpoint, hash_block, mamba_block, alignment)
        is valid
    )


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 100, 96, 16, 16, 0), "checkpoint_alignment=0"),
        ((0, 100, 96, 16, 0, 16), "mamba_block_size=0"),
        ((0, 100, 96, 0, 16, 16), "hash_block_size=0"),
        ((50, 40, 45, 16, 16, 16), "query_end=40"),
        ((-16, 100, 96, 16, 16, 16), "query_start=-16"),
        ((0, 100, -1, 16, 16, 16), "checkpoint_position=-1"),
    ],
)
def test_checkpoint_validity_refuses_bad_input(args: tuple, match: str) -> None:
    with pytest.raises(KVSpecError, match=match):
        is_prefill_checkpoint_valid(*args)


@settings(max_examples=100, deadline=None)
@given(
    num_tokens=st.integers(0, 1 << 20), hash_block=st.integers(1, 4096), drop_eagle=st.booleans()
)
def test_position_is_a_boundary_before_the_last_token(
    num_tokens: int, hash_block: int, drop_eagle: bool
) -> None:
    position = prefill_checkpoint_position(num_tokens, hash_block, drop_eagle)
    assert position % hash_block == 0 and position >= 0
    assert position <= max(num_tokens - 1, 0)
    assert num_tokens - 1 - position < hash_block * (2 if drop_eagle else 1) or position == 0
    assert prefill_checkpoint_position(num_tokens + 1, hash_block, drop_eagle) >= position


@settings(max_examples=100, deadline=None)
@given(
    start_blocks=st.integers(0, 64),
    length=st.integers(0, 4096),
    checkpoint=st.integers(0, 8192),
    hash_block=st.sampled_from([16, 32, 64]),
    mamba_block=st.sampled_from([16, 64, 256]),
    alignment=st.sampled_from([1, 16, 64]),
)
def test_a_valid_checkpoint_is_aligned_and_inside_the_query(
    start_blocks: int,
    length: int,
    checkpoint: int,
    hash_block: int,
    mamba_block: int,
    alignment: int,
) -> None:
    start = start_blocks * hash_block
    end = start + length
    if is_prefill_checkpoint_valid(start, end, checkpoint, hash_block, mamba_block, alignment):
        assert start + hash_block <= checkpoint < end
        assert (checkpoint - start) % alignment == 0
        assert not is_prefill_checkpoint_valid(
            start, end, checkpoint, hash_block, mamba_block, None
        )
