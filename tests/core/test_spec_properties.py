"""Hypothesis properties of the spec protocol."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVSpecError,
    PluginManager,
    SinkFullAttentionSpec,
    SizingContext,
)
from kvspec_core.kv_dtypes import BUILTIN_QUANT_MODES
from kvspec_core.specs import spec_from_dict, spec_to_dict
from kvspec_core.testing import check_spec_protocol

anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(1 << 64), max_value=1 << 64),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.just(torch.bfloat16),
    st.fractions(),
    st.sampled_from(BUILTIN_QUANT_MODES),
    st.lists(st.integers(), max_size=2),
)
REQUIRED = ["block_size", "num_kv_heads", "head_size", "dtype"]
OPTIONAL = [
    "head_size_v",
    "kv_quant_mode",
    "dcp_sharded",
    "block_stride_alignment",
    "max_tp_shards",
    "page_size_padded",
    "num_head_slots",
    "state_content_bytes",
    "tokens_per_state",
    "sliding_window",
    "attention_chunk_size",
    "non_causal",
]


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries({name: anything for name in REQUIRED}),
    st.dictionaries(st.sampled_from(OPTIONAL), anything, max_size=len(OPTIONAL)),
)
def test_random_fields_give_a_spec_or_a_kvspec_error(required: dict, optional: dict) -> None:
    try:
        spec = FullAttentionSpec(**required, **optional)
    except KVSpecError:
        return
    assert spec.page_size_bytes > 0


valid_specs = st.builds(
    FullAttentionSpec,
    block_size=st.sampled_from([1, 16, 32, 128]),
    num_kv_heads=st.integers(1, 16),
    head_size=st.sampled_from([64, 80, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    tokens_per_state=st.sampled_from([1, Fraction(1, 2)]),
    sliding_window=st.none() | st.integers(1, 8192),
    non_causal=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(valid_specs)
def test_valid_specs_satisfy_the_protocol(spec: FullAttentionSpec) -> None:
    check_spec_protocol(spec, PluginManager())
    assert (
        spec_from_dict(json.loads(json.dumps(spec_to_dict(spec))), PluginManager().spec_kinds)
        == spec
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.none() | st.just(512), st.booleans()), min_size=1, max_size=6),
    st.randoms(),
)
def test_full_attention_merge_is_order_independent_and_idempotent(variants, rng) -> None:
    specs = [
        FullAttentionSpec(
            block_size=16,
            num_kv_heads=8,
            head_size=128,
            dtype=torch.bfloat16,
            sliding_window=window,
            non_causal=non_causal,
        )
        for window, non_causal in variants
    ]
    merged = FullAttentionSpec.merge(specs)
    shuffled = list(specs)
    rng.shuffle(shuffled)
    assert FullAttentionSpec.merge(shuffled) == merged
    assert FullAttentionSpec.merge([merged, merged]) == merged


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 1 << 20), st.integers(1, 1 << 20), st.integers(1, 8))
def test_memory_never_decreases_with_max_model_len(a: int, b: int, dcp: int) -> None:
    short, long = sorted((a, b))
    for spec in (
        FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16),
        SinkFullAttentionSpec(
            block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float16, sink_len=4
        ),
    ):
        assert spec.max_memory_usage_bytes(
            SizingContext(max_model_len=short, dcp_size=dcp)
        ) <= spec.max_memory_usage_bytes(SizingContext(max_model_len=long, dcp_size=dcp))


@pytest.mark.parametrize(
    "spec_class", [FullAttentionSpec, SinkFullAttentionSpec, CrossAttentionSpec]
)
def test_core_specs_pass_the_protocol_checks(spec_class) -> None:
    check_spec_protocol(
        spec_class(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float16),
        PluginManager(),
    )
