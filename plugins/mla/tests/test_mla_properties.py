"""Invariants of the MLA specs, checked with hypothesis."""

from __future__ import annotations

import itertools

import attrs
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core import SizingContext
from kvspec_core.errors import MergeError
from kvspec_core.specs import KVSpec
from kvspec_core.testing import check_sizing_invariants
from kvspec_mla import (
    CircularBufferSpec,
    HiddenStateCacheSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)

PROFILE = settings(max_examples=60, deadline=None)

block_sizes = st.sampled_from([1, 16, 64, 256])
dtypes = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])


@st.composite
def mla_specs(draw: st.DrawFn, cls: type[MLAAttentionSpec] = MLAAttentionSpec) -> MLAAttentionSpec:
    packed = draw(st.booleans())
    block_size = draw(block_sizes)
    return cls(
        block_size=block_size,
        num_kv_heads=1,
        head_size=576 if packed else draw(st.sampled_from([64, 512, 576])),
        dtype=torch.uint8 if packed else draw(dtypes),
        cache_dtype_str=draw(st.sampled_from(["fp8_ds_mla", "nvfp4_ds_mla"])) if packed else None,
        alignment=draw(st.sampled_from([None, 256, 576, 4096])),
        cache_role=draw(st.sampled_from(["sparse", "indexer"])),
        dcp_sharded=draw(st.booleans()),
        non_causal_multi_token_decode=draw(st.booleans()),
        tokens_per_state=draw(st.sampled_from([1, 4])) if block_size >= 4 and not packed else 1,
    )


@st.composite
def sliding_specs(draw: st.DrawFn) -> SlidingWindowMLASpec:
    base = draw(mla_specs())
    return SlidingWindowMLASpec(
        block_size=base.block_size,
        num_kv_heads=1,
        head_size=base.head_size,
        dtype=base.dtype,
        cache_dtype_str=base.cache_dtype_str,
        alignment=base.alignment,
        sliding_window=draw(st.integers(1, 1 << 16)),
        extra_retained_tokens=draw(st.integers(0, 64)),
        bounded_replay=draw(st.booleans()),
    )


def rings() -> st.SearchStrategy[CircularBufferSpec]:
    return st.builds(
        CircularBufferSpec,
        block_size=block_sizes,
        num_kv_heads=st.integers(1, 8),
        head_size=st.sampled_from([64, 128, 512]),
        dtype=dtypes,
    )


any_spec = st.one_of(mla_specs(), mla_specs(HiddenStateCacheSpec), sliding_specs(), rings())
contexts = st.builds(
    SizingContext,
    max_model_len=st.integers(1, 1 << 22),
    max_in_flight_tokens=st.integers(1, 1 << 17),
    dcp_size=st.sampled_from([1, 2, 4, 8]),
)


def _merge_outcome(specs: list[KVSpec], names: list[str]) -> KVSpec | type[MergeError]:
    try:
        return type(specs[0]).merge(specs, names)
    except MergeError:
        return MergeError


@PROFILE
@given(
    pool=st.lists(mla_specs(), min_size=1, max_size=2),
    picks=st.lists(st.integers(0, 1), min_size=1, max_size=4),
)
def test_mla_merge_is_order_independent_and_idempotent(
    pool: list[MLAAttentionSpec], picks: list[int]
) -> None:
    # Varying only the any-merged flag keeps many groups mergeable.
    pool = pool + [attrs.evolve(pool[0], non_causal_multi_token_decode=True)]
    specs = [pool[pick % len(pool)] for pick in picks] + [pool[-1]]
    names = [f"l{i}" for i in range(len(specs))]
    outcomes = {
        repr(_merge_outcome([specs[i] for i in order], [names[i] for i in order]))
        for order in itertools.islice(itertools.permutations(range(len(specs))), 24)
    }
    assert len(outcomes) == 1
    merged = _merge_outcome(specs, names)
    if merged is not MergeError:
        assert MLAAttentionSpec.merge([merged], ["g"]) == merged
        assert MLAAttentionSpec.merge([merged, merged], ["g0", "g1"]) == merged
        assert MLAAttentionSpec.merge([*specs, merged], [*names, "g"]) == merged
    for spec in pool:
        assert MLAAttentionSpec.merge([spec, spec, spec], ["a", "b", "c"]) == spec


@PROFILE
@given(a=sliding_specs(), b=sliding_specs())
def test_sliding_mla_merge_is_symmetric(a: SlidingWindowMLASpec, b: SlidingWindowMLASpec) -> None:
    assert repr(_merge_outcome([a, b], ["x", "y"])) == repr(_merge_outcome([b, a], ["y", "x"]))
    assert SlidingWindowMLASpec.merge([a, a], ["x", "y"]) == a


@PROFILE
@given(
    spec=any_spec,
    ctx=contexts,
    longer_by=st.integers(0, 1 << 22),
    busier_by=st.integers(0, 1 << 17),
)
def test_sizing_is_monotone_and_one_formula(
    spec: KVSpec, ctx: SizingContext, longer_by: int, busier_by: int
) -> None:
    check_sizing_invariants(spec, ctx, longer_by=longer_by, busier_by=busier_by)


@PROFILE
@given(spec=any_spec)
def test_page_is_padded_below_one_alignment_step(spec: KVSpec) -> None:
    assert spec.page_size_bytes >= spec.unpadded_page_size_bytes
    alignment = getattr(spec, "alignment", None)
    if alignment is not None:
        assert spec.page_size_bytes % alignment == 0
        assert spec.page_size_bytes - spec.unpadded_page_size_bytes < alignment
