"""Hypothesis invariants of the Mamba state family."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core import SizingContext
from kvspec_core.context import MAMBA_CACHE_MODES
from kvspec_core.errors import MergeError
from kvspec_core.testing import check_sizing_invariants
from kvspec_mamba import MambaSpec

specs = st.builds(
    MambaSpec,
    block_size=st.sampled_from([16, 64]),
    shapes=st.sampled_from([((3, 8192), (8192, 16)), ((3, 10240), (128, 64, 128))]),
    dtypes=st.sampled_from([(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]),
    page_size_padded=st.sampled_from([None, 8 << 20]),
    mamba_type=st.sampled_from(["mamba1", "mamba2"]),
    num_speculative_blocks=st.integers(0, 2),
    num_prefill_checkpoint_blocks=st.integers(0, 1),
    prefill_checkpoint_alignment=st.sampled_from([None, 16]),
    tp_replicated=st.booleans(),
)


def merged_or_refused(items: list[Any]) -> Any:
    try:
        return MambaSpec.merge(items, [f"l{i}" for i in range(len(items))])
    except MergeError:
        return MergeError


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_merge_is_order_independent_and_idempotent(data: st.DataObject) -> None:
    # Draw a few specs and repeat some, so that merges both succeed and fail.
    distinct = data.draw(st.lists(specs, min_size=1, max_size=2))
    items = data.draw(st.lists(st.sampled_from(distinct), min_size=1, max_size=5))
    result = merged_or_refused(items)
    assert merged_or_refused(data.draw(st.permutations(items))) == result
    assert merged_or_refused(items + items) == result
    if result is not MergeError:
        assert MambaSpec.merge([result, result]) == result


contexts = st.builds(
    SizingContext,
    max_model_len=st.integers(1, 1 << 20),
    max_in_flight_tokens=st.integers(1, 1 << 16),
    dcp_size=st.sampled_from([1, 2, 8]),
    mamba_cache_mode=st.sampled_from(MAMBA_CACHE_MODES),
)


@settings(max_examples=80, deadline=None)
@given(spec=specs, ctx=contexts, more=st.integers(0, 1 << 20))
def test_sizing_is_monotone_and_one_formula(spec: MambaSpec, ctx: SizingContext, more: int) -> None:
    check_sizing_invariants(spec, ctx, longer_by=more, busier_by=more)
