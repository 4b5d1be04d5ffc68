"""Hypothesis invariants of the chunked local attention family."""

from __future__ import annotations

from typing import Any

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_chunked_local import ChunkedLocalAttentionSpec
from kvspec_core import SizingContext
from kvspec_core.errors import MergeError
from kvspec_core.testing import check_sizing_invariants

specs = st.builds(
    ChunkedLocalAttentionSpec,
    block_size=st.sampled_from([16, 32]),
    num_kv_heads=st.sampled_from([1, 8]),
    head_size=st.sampled_from([64, 128]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    attention_chunk_size=st.sampled_from([8192, 24]),
    dcp_sharded=st.booleans(),
)


def merged_or_refused(items: list[Any]) -> Any:
    try:
        return ChunkedLocalAttentionSpec.merge(items, [f"l{i}" for i in range(len(items))])
    except MergeError:
        return MergeError


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_merge_is_order_independent_and_idempotent(data: st.DataObject) -> None:
    items = data.draw(st.lists(specs, min_size=1, max_size=4))
    result = merged_or_refused(items)
    assert merged_or_refused(data.draw(st.permutations(items))) == result
    assert merged_or_refused(items + items) == result
    if result is not MergeError:
        assert ChunkedLocalAttentionSpec.merge([result, result]) == result


contexts = st.builds(
    SizingContext,
    max_model_len=st.integers(1, 1 << 20),
    max_in_flight_tokens=st.integers(1, 1 << 16),
    dcp_size=st.sampled_from([1, 2, 3, 8]),
)


@settings(max_examples=80, deadline=None)
@given(spec=specs, ctx=contexts, more=st.integers(0, 1 << 20))
def test_sizing_is_monotone_and_one_formula(
    spec: ChunkedLocalAttentionSpec, ctx: SizingContext, more: int
) -> None:
    check_sizing_invariants(spec, ctx, longer_by=more, busier_by=more)
    longer = attrs.evolve(ctx, max_model_len=ctx.max_model_len + more)
    busier = attrs.evolve(ctx, max_in_flight_tokens=ctx.max_in_flight_tokens + more)
    for context in (ctx, longer, busier):
        assert (
            spec.max_blocks_per_request(context)
            <= spec.block_table_width(context, context.max_model_len) + 1
        )
