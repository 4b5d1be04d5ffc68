"""Invariants of the HiSparse specs and host-pool sizing, checked with hypothesis."""

from __future__ import annotations

import itertools

import pytest
from hisparse_testkit import latent_like
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core import SizingContext
from kvspec_core.errors import CapacityError, MergeError
from kvspec_core.specs import KVSpec
from kvspec_core.testing import check_sizing_invariants
from kvspec_hisparse import HiSparseGroupSpec, HiSparseHotSpec, HiSparseResidentSpec, size_host_pool

PROFILE = settings(max_examples=60, deadline=None)

block_sizes = st.sampled_from([1, 16, 64, 256])
pages = st.integers(1, 1 << 22)
hots = st.builds(
    HiSparseHotSpec,
    block_size=block_sizes,
    page_size=pages,
    blocks_per_request=st.integers(1, 4096),
)
residents = st.builds(HiSparseResidentSpec, block_size=block_sizes, page_size=pages)
groups = st.builds(
    lambda block, heads, role: HiSparseGroupSpec(
        inner=latent_like(block_size=block, num_kv_heads=heads), role=role
    ),
    block_sizes,
    st.integers(1, 4),
    st.sampled_from(["hisparse_source", "hisparse_indexer"]),
)
any_spec = st.one_of(hots, residents, groups)
contexts = st.builds(
    SizingContext,
    max_model_len=st.integers(1, 1 << 22),
    max_in_flight_tokens=st.integers(1, 1 << 17),
    dcp_size=st.sampled_from([1, 2, 4]),
)


def _outcome(specs: list[KVSpec], names: list[str]) -> str:
    try:
        return repr(type(specs[0]).merge(specs, names))
    except MergeError:
        return "MergeError"


@PROFILE
@given(
    pool=st.one_of(
        st.lists(hots, min_size=1, max_size=2),
        st.lists(residents, min_size=1, max_size=2),
        st.lists(groups, min_size=1, max_size=2),
    ),
    picks=st.lists(st.integers(0, 1), min_size=1, max_size=4),
)
def test_merge_is_order_independent_and_idempotent(pool: list[KVSpec], picks: list[int]) -> None:
    specs = [pool[pick % len(pool)] for pick in picks]
    names = [f"l{i}" for i in range(len(specs))]
    outcomes = {
        _outcome([specs[i] for i in order], [names[i] for i in order])
        for order in itertools.permutations(range(len(specs)))
    }
    assert len(outcomes) == 1
    for spec in pool:
        assert type(spec).merge([spec, spec, spec], ["a", "b", "c"]) == spec
    if outcomes != {"MergeError"}:
        merged = type(specs[0]).merge(specs, names)
        assert type(merged).merge([merged, *specs], ["g", *names]) == merged


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
@given(
    budget=st.integers(0, 1 << 50),
    page_sizes=st.lists(pages, min_size=1, max_size=64),
    alignment=st.sampled_from([1, 2, 256, 576, 4096, 1 << 21]),
    more=st.integers(0, 1 << 40),
)
def test_host_pool_never_exceeds_the_budget_and_grows_with_it(
    budget: int, page_sizes: list[int], alignment: int, more: int
) -> None:
    page_bytes = sum(page_sizes)
    stride = -(-page_bytes // alignment) * alignment
    if budget < stride:
        with pytest.raises(CapacityError):
            size_host_pool(budget, page_sizes, alignment=alignment)
        return
    pool = size_host_pool(budget, page_sizes, alignment=alignment)
    assert pool.block_stride_bytes == stride
    assert pool.block_stride_bytes % alignment == 0
    assert 0 <= pool.block_stride_bytes - pool.page_bytes < alignment
    assert pool.pool_bytes <= budget < pool.pool_bytes + pool.block_stride_bytes
    assert size_host_pool(budget + more, page_sizes, alignment=alignment).num_blocks >= (
        pool.num_blocks
    )
