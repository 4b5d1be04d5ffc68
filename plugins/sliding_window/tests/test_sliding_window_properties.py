"""Hypothesis invariants of the sliding-window families."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core import SizingContext
from kvspec_core.errors import MergeError
from kvspec_core.testing import check_sizing_invariants
from kvspec_sliding_window import KpoolTailSpec, ReferenceSlidingWindowSpec, SlidingWindowSpec

SPEC_CLASSES = [SlidingWindowSpec, KpoolTailSpec, ReferenceSlidingWindowSpec]


@st.composite
def specs_of(draw: st.DrawFn, cls: type) -> Any:
    # Few values per field so that drawn lists often merge and sometimes disagree.
    fields: dict[str, Any] = dict(
        block_size=draw(st.sampled_from([16, 32])),
        num_kv_heads=draw(st.sampled_from([1, 8])),
        head_size=draw(st.sampled_from([64, 128])),
        dtype=draw(st.sampled_from([torch.bfloat16, torch.float32])),
        dcp_sharded=draw(st.booleans()),
    )
    if cls is ReferenceSlidingWindowSpec:
        fields["rswa_window"] = draw(st.sampled_from([64, 512]))
        fields["non_causal"] = draw(st.booleans())
        fields["sliding_window"] = draw(st.sampled_from([None, 1024]))
    else:
        fields["sliding_window"] = draw(st.sampled_from([128, 4096]))
        fields["extra_retained_tokens"] = draw(st.sampled_from([0, 3]))
    return cls(**fields)


def merged_or_refused(cls: type, specs: list[Any]) -> Any:
    try:
        return cls.merge(specs, [f"layer{i}" for i in range(len(specs))])
    except MergeError:
        return MergeError


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_merge_is_order_independent_and_idempotent(cls: type, data: st.DataObject) -> None:
    specs = data.draw(st.lists(specs_of(cls), min_size=1, max_size=4))
    order = data.draw(st.permutations(specs))
    result = merged_or_refused(cls, specs)
    assert merged_or_refused(cls, order) == result
    assert merged_or_refused(cls, specs + specs) == result
    if result is not MergeError:
        assert cls.merge([result, result]) == result
        for spec in specs:
            assert cls.merge([spec]) == spec


contexts = st.builds(
    SizingContext,
    max_model_len=st.integers(1, 1 << 20),
    max_in_flight_tokens=st.integers(1, 1 << 16),
    dcp_size=st.sampled_from([1, 2, 3, 8]),
)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@settings(max_examples=40, deadline=None)
@given(data=st.data(), ctx=contexts, more=st.integers(0, 1 << 20))
def test_sizing_is_monotone_and_one_formula(
    cls: type, data: st.DataObject, ctx: SizingContext, more: int
) -> None:
    spec = data.draw(specs_of(cls))
    check_sizing_invariants(spec, ctx, longer_by=more, busier_by=more)
    longer = attrs.evolve(ctx, max_model_len=ctx.max_model_len + more)
    busier = attrs.evolve(ctx, max_in_flight_tokens=ctx.max_in_flight_tokens + more)
    for context in (ctx, longer, busier):
        # A request never holds more blocks than its block-table row has entries.
        assert (
            spec.max_blocks_per_request(context)
            <= spec.block_table_width(context, context.max_model_len) + 1
        )
