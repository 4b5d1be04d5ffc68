"""Hypothesis properties: random hybrid spec sets, budgets and layouts."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_testkit import (
    ChunkSpec,
    HostSpec,
    RawSpec,
    StateSpec,
    WindowSpec,
    assert_views_sound,
    manager_with_test_kinds,
)

from kvspec_core import SizingContext
from kvspec_core.errors import PlanError
from kvspec_core.planner import LAYOUTS, plan_kv_cache
from kvspec_core.planner.budget import bytes_for_one_request
from kvspec_core.specs import FullAttentionSpec, KVSpec

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def attention_fields(draw: st.DrawFn, block_size: int) -> dict:
    heads = draw(st.integers(1, 3))
    head = draw(st.sampled_from([4, 8, 12]))
    dtype = draw(st.sampled_from(DTYPES))
    fields = dict(block_size=block_size, num_kv_heads=heads, head_size=head, dtype=dtype)
    unpadded = block_size * heads * 2 * head * dtype.itemsize
    if draw(st.booleans()) and draw(st.booleans()):
        fields["page_size_padded"] = unpadded + 16 * draw(st.integers(1, 4))
    if draw(st.booleans()) and draw(st.booleans()):
        fields["block_stride_alignment"] = draw(st.sampled_from([64, 256]))
    return fields


@st.composite
def layer_spec(draw: st.DrawFn) -> KVSpec:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    family = draw(st.sampled_from(["full", "window", "chunk", "state", "raw", "host"]))
    if family == "state":
        return StateSpec(
            block_size=block_size,
            state_bytes=8 * draw(st.integers(1, 64)),
            states_per_request=draw(st.integers(1, 3)),
        )
    if family == "raw":
        return RawSpec(
            block_size=block_size,
            page_bytes=16 * draw(st.integers(1, 16)),
            blocks=draw(st.integers(1, 4)),
        )
    fields = draw(attention_fields(block_size))
    if family == "full":
        return FullAttentionSpec(**fields)
    if family == "host":
        return HostSpec(**fields)
    if family == "window":
        return WindowSpec(window=draw(st.integers(1, 24)), **fields)
    return ChunkSpec(chunk=draw(st.integers(1, 24)), **fields)


@st.composite
def hybrid_models(draw: st.DrawFn) -> dict[str, KVSpec]:
    palette = draw(st.lists(layer_spec(), min_size=1, max_size=3))
    count = draw(st.integers(1, 10))
    return {f"layer.{i}": draw(st.sampled_from(palette)) for i in range(count)}


@st.composite
def uniform_type_models(draw: st.DrawFn) -> dict[str, KVSpec]:
    """Full attention of one block size but several shapes: one uniform-type group."""
    block_size = draw(st.sampled_from([2, 4]))
    palette = [FullAttentionSpec(**draw(attention_fields(block_size))) for _ in range(3)]
    count = draw(st.integers(2, 8))
    return {f"layer.{i}": draw(st.sampled_from(palette)) for i in range(count)}


def models() -> st.SearchStrategy[dict[str, KVSpec]]:
    return st.one_of(hybrid_models(), uniform_type_models())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    models(),
    st.sampled_from(list(LAYOUTS)),
    st.integers(0, 3000),
    st.integers(1, 48),
    st.integers(1, 16),
)
def test_random_hybrid_plans_are_sound(specs, layout, extra, max_len, in_flight) -> None:
    manager = manager_with_test_kinds()
    ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight)
    try:
        probe = plan_kv_cache(
            specs, 1 << 40, ctx, manager, layout=layout, host_budget_bytes=1 << 40
        )
    except PlanError as error:
        # Only padded pages under a layout that puts heads outside the page are refused.
        assert layout in ("LHBNC", "BHLNC") and "padded" in str(error)
        return

    def need(host: bool) -> int:
        pools = [p for p in probe.pools if p.host_resident == host]
        return bytes_for_one_request(
            [p.blocks_per_request for p in pools], [p.block_bytes for p in pools]
        )

    budget = need(False) + extra * 8
    host_budget = need(True) + extra * 4
    plan = plan_kv_cache(specs, budget, ctx, manager, layout=layout, host_budget_bytes=host_budget)

    # Within budget, one request fits, block sizes untouched, every live layer planned once.
    assert plan.bytes_allocated <= budget and plan.host_bytes_allocated <= host_budget
    assert plan.bytes_allocated + plan.padding_breakdown[2][1] == budget
    assert all(bytes_ >= 0 for _, bytes_ in plan.padding_breakdown)
    assert plan.num_blocks == sum(pool.num_blocks for pool in plan.pools)
    for pool in plan.pools:
        assert pool.num_blocks >= pool.blocks_per_request + 1
    assert plan.max_concurrency >= 1.0
    planned = [layer for group in plan.groups for layer in group.layers]
    assert sorted(planned + list(plan.memoryless_layers)) == sorted(specs)
    for group in plan.groups:
        for layer, spec in zip(group.layers, group.layer_specs, strict=True):
            assert spec.block_size == specs[layer].block_size

    assert_views_sound(plan)


@settings(max_examples=30, deadline=None)
@given(models(), st.sampled_from(["LBHNC", "BLHNC", "LBNHC"]), st.integers(0, 100000))
def test_aliased_layers_never_share_bytes_across_block_ids(specs, layout, extra) -> None:
    manager = manager_with_test_kinds()
    ctx = SizingContext(max_model_len=16, max_in_flight_tokens=4)
    probe = plan_kv_cache(specs, 1 << 40, ctx, manager, layout=layout, host_budget_bytes=1 << 40)
    need = bytes_for_one_request(
        [p.blocks_per_request for p in probe.pools], [p.block_bytes for p in probe.pools]
    )
    plan = plan_kv_cache(
        specs, need + extra, ctx, manager, layout=layout, host_budget_bytes=need + extra
    )
    for tensor in plan.tensors:
        for position, layer in enumerate(tensor.layers):
            for other in plan.aliased_layers(layer):
                twin = next(t for t in plan.tensors if other in t.layers)
                # Same slot: the same byte range for the same block id.
                assert tensor.block_stride == twin.block_stride
                assert (
                    tensor.offset + position * tensor.layer_stride
                    == twin.offset + twin.layers.index(other) * twin.layer_stride
                )
