"""Worked examples: the chunked local attention spec against the reference formulas."""

from __future__ import annotations

import re

import pytest
import torch
from chunked_local_testkit import chunked_fields, manager_with_plugin

from kvspec_chunked_local import ChunkedLocalAttentionSpec
from kvspec_core import FullAttentionSpec, SizingContext, UniformTypeSpecs
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, MergeError
from kvspec_core.specs import spec_from_dict, spec_to_dict

# Llama-4-Scout: 16 tokens x 8 heads x (128 K + 128 V) x 2 B.
SCOUT_PAGE = 16 * 8 * 256 * 2


def test_page_size_unpadded_and_padded() -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields())
    assert spec.page_size_bytes == spec.unpadded_page_size_bytes == SCOUT_PAGE == 65536
    padded = ChunkedLocalAttentionSpec(**chunked_fields(page_size_padded=SCOUT_PAGE + 512))
    assert padded.page_size_bytes == SCOUT_PAGE + 512
    assert padded.unpadded_page_size_bytes == SCOUT_PAGE
    with pytest.raises(InvalidFieldError, match="page_size_padded"):
        ChunkedLocalAttentionSpec(**chunked_fields(page_size_padded=SCOUT_PAGE - 1))


# (chunk, in_flight, max_model_len, block, blocks) from cdiv(min(chunk + in_flight, max_len),
# block), worked by hand.
ADMISSION_CASES = [
    (8192, 16384, 262144, 16, 1536),  # 24576 / 16
    (8192, 16384, 10000, 16, 625),  # capped at 10000 -> 625
    (8192, 1, 262144, 16, 513),  # 8193 -> 512.06 -> 513
    (8192, 2048, 262144, 64, 160),  # 10240 / 64
    (32, 8, 1000, 16, 3),  # 40 -> 2.5 -> 3
    (16, 1, 1, 16, 1),  # a one-token request
]


@pytest.mark.parametrize("chunk, in_flight, max_len, block, blocks", ADMISSION_CASES)
def test_admission_cap_and_max_memory(
    chunk: int, in_flight: int, max_len: int, block: int, blocks: int
) -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields(attention_chunk_size=chunk, block_size=block))
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight)
    assert spec.max_blocks_per_request(ctx) == blocks
    assert spec.max_memory_usage_bytes(ctx) == blocks * spec.page_size_bytes


def test_unaligned_chunk_adds_the_block_a_chunk_boundary_straddles() -> None:
    # chunk 24, block 16: chunk 1 starts mid-block; with 47 tokens computed and 1 in flight
    # positions 24..48 live in blocks 1, 2 and 3, one more than cdiv(25, 16) = 2.
    spec = ChunkedLocalAttentionSpec(**chunked_fields(attention_chunk_size=24))
    ctx = SizingContext(max_model_len=1000, max_in_flight_tokens=1)
    assert spec.max_blocks_per_request(ctx) == 3


@pytest.mark.parametrize(
    "dcp, sharded, blocks",
    [
        (1, True, 1536),
        (2, True, 768),  # cdiv(24576, 32)
        (8, True, 192),  # cdiv(24576, 128)
        (3, True, 513),  # cdiv(24576, 48) = 512, and 48 does not divide 8192: +1
        (8, False, 1536),  # a replicated cache holds every token on every rank
    ],
)
def test_admission_cap_under_decode_context_parallelism(
    dcp: int, sharded: bool, blocks: int
) -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields(dcp_sharded=sharded))
    ctx = SizingContext(max_model_len=262144, max_in_flight_tokens=16384, dcp_size=dcp)
    assert spec.max_blocks_per_request(ctx) == blocks
    assert spec.max_memory_usage_bytes(ctx) == blocks * SCOUT_PAGE


@pytest.mark.parametrize(
    "max_len, dcp, width", [(262144, 1, 16384), (262144, 8, 2048), (100, 1, 7), (100, 4, 2)]
)
def test_block_table_width_covers_every_position(max_len: int, dcp: int, width: int) -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields())
    assert (
        spec.block_table_width(SizingContext(max_model_len=max_len, dcp_size=dcp), max_len) == width
    )


def test_runtime_properties() -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields())
    assert (spec.prefix_cacheable, spec.uses_slot_mapping, spec.has_layer_views) == (
        True,
        True,
        True,
    )
    assert spec.block_table_token_alignment == 128 and spec.dcp_sharded


@pytest.mark.parametrize(
    "value, error",
    [
        (0, InvalidFieldError),
        (-8192, InvalidFieldError),
        (True, InvalidFieldTypeError),
        ("8192", InvalidFieldTypeError),
    ],
)
def test_invalid_chunk_is_refused(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=r"ChunkedLocalAttentionSpec\.attention_chunk_size="):
        ChunkedLocalAttentionSpec(**chunked_fields(attention_chunk_size=value))


def test_merge_of_equal_layers_returns_the_spec() -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields())
    assert ChunkedLocalAttentionSpec.merge([spec, spec], ["a", "b"]) == spec


@pytest.mark.parametrize(
    "field, other",
    [
        ("attention_chunk_size", 4096),
        ("num_kv_heads", 4),
        ("dtype", torch.float16),
        ("dcp_sharded", False),
    ],
)
def test_merge_refusal_names_field_values_and_layers(field: str, other: object) -> None:
    base = ChunkedLocalAttentionSpec(**chunked_fields())
    odd = ChunkedLocalAttentionSpec(**chunked_fields(**{field: other}))
    with pytest.raises(MergeError) as caught:
        ChunkedLocalAttentionSpec.merge([odd, base], ["layers.0", "layers.1"])
    message = str(caught.value)
    assert (
        f"field {field!r} differs ({other!r} in layers.0; {getattr(base, field)!r} in "
        "layers.1)" in message
    )


def test_merge_refuses_full_attention_among_chunked_layers() -> None:
    with pytest.raises(MergeError, match=re.escape("layers.3 is a FullAttentionSpec")):
        ChunkedLocalAttentionSpec.merge(
            [
                ChunkedLocalAttentionSpec(**chunked_fields()),
                FullAttentionSpec(**chunked_fields(attention_chunk_size=8192)),
            ],
            ["layers.0", "layers.3"],
        )


def test_uniformity_decisions() -> None:
    registry = manager_with_plugin().spec_kinds
    spec = ChunkedLocalAttentionSpec(**chunked_fields())
    other_shape = ChunkedLocalAttentionSpec(**chunked_fields(num_kv_heads=2, head_size=64))
    other_chunk = ChunkedLocalAttentionSpec(**chunked_fields(attention_chunk_size=4096))
    full = FullAttentionSpec(**chunked_fields(attention_chunk_size=None))

    def uniform(*specs: object) -> bool:
        return UniformTypeSpecs.is_uniform_type({f"l{i}": s for i, s in enumerate(specs)}, registry)  # type: ignore[misc]

    assert uniform(spec, other_shape)
    assert not uniform(spec, other_chunk)
    assert not uniform(spec, full) and not uniform(full, spec)
    group = UniformTypeSpecs.from_specs({"a": spec, "b": other_shape}, registry)
    assert group is not None
    assert group.max_blocks_per_request(SizingContext(max_model_len=262144)) == 1536


def test_round_trip_through_plain_data() -> None:
    spec = ChunkedLocalAttentionSpec(**chunked_fields(page_size_padded=70000))
    assert spec_from_dict(spec_to_dict(spec), manager_with_plugin().spec_kinds) == spec
