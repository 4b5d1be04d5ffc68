"""Cross-layer KV sharing in the planner: readers hold no blocks, view their source's bytes,
and every bad pairing is refused naming the layer, the field and the fix."""

from __future__ import annotations

import json
import re
import time

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_testkit import assert_views_sound, full, layers, manager_with_test_kinds, window
from test_planner_properties import hybrid_models

from kvspec_core import SizingContext
from kvspec_core.errors import ConfigError, InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.planner import materialize, plan_from_dict, plan_kv_cache, reconcile_plans
from kvspec_core.specs import EncoderOnlyAttentionSpec, KVSharingSpec, KVSpec

CTX = SizingContext(max_model_len=4096, max_in_flight_tokens=512)
SMALL = SizingContext(max_model_len=256, max_in_flight_tokens=32)


def reads(target: str, spec: KVSpec) -> KVSharingSpec:
    return KVSharingSpec(target_layer=target, reader_spec=spec)


def yoco(n_self: int = 4, n_cross: int = 4, **fields: object) -> dict[str, KVSpec]:
    """YOCO-like: a self-decoder of windowed layers, then one full-attention layer whose
    cache every cross-decoder layer reads."""
    specs = layers([window(64, **fields) for _ in range(n_self)] + [full(**fields)])
    source = f"model.layers.{n_self}"
    for index in range(n_self + 1, n_self + 1 + n_cross):
        specs[f"model.layers.{index}"] = reads(source, full(**fields))
    return specs


#: Small pages, so that checking every byte of the views stays quick.
TINY = dict(num_kv_heads=1, head_size=8)


def test_readers_hold_no_blocks_exact_formula() -> None:
    """Blocks and bytes are those of the layers holding a cache, nothing for the readers:
    4 window layers + 1 full layer, block 16, 8 heads x (128 + 128) x 2 B."""
    manager = manager_with_test_kinds()
    page = 16 * 8 * 256 * 2
    budget = 3 << 30
    plan = plan_kv_cache(yoco(), budget, CTX, manager)
    assert plan.memoryless_layers == tuple(f"model.layers.{i}" for i in range(5, 9))
    assert plan.kv_sharing == tuple((f"model.layers.{i}", "model.layers.4") for i in range(5, 9))
    held = [layer for group in plan.groups for layer in group.layers]
    assert sorted(held) == [f"model.layers.{i}" for i in range(5)]
    # window: cdiv(64 - 1 + 512, 16) + 1 = 37 blocks; full: 4096 / 16 = 256 blocks.
    assert sorted(group.blocks_per_request for group in plan.groups) == [37, 37, 37, 37, 256]
    (pool,) = plan.pools
    assert pool.block_bytes == page
    assert pool.blocks_per_request == 4 * 37 + 256
    # One pool of one page per block: budget // page blocks, the null block not usable.
    assert pool.num_blocks == budget // page
    assert plan.bytes_allocated == pool.num_blocks * page
    assert plan.max_concurrency == pytest.approx((budget // page - 1) / (4 * 37 + 256))
    # The same figures as the model without its readers: they cost nothing.
    alone = plan_kv_cache(yoco(n_cross=0), budget, CTX, manager)
    assert (alone.groups, alone.pools, alone.tensors) == (plan.groups, plan.pools, plan.tensors)
    assert alone.max_concurrency == plan.max_concurrency


def test_materialize_views_a_reader_over_its_sources_bytes() -> None:
    plan = plan_kv_cache(
        yoco(n_self=2, n_cross=2, **TINY), 1 << 16, SMALL, manager_with_test_kinds()
    )
    buffers = materialize(plan)
    source, reader = buffers.views["model.layers.2"], buffers.views["model.layers.3"]
    assert reader is not source  # a view of its own ...
    assert reader.data_ptr() == source.data_ptr()  # ... over the same storage
    assert (reader.shape, reader.stride(), reader.dtype) == (
        source.shape,
        source.stride(),
        source.dtype,
    )
    reader.zero_()
    source[5, 0, 3].fill_(1.5)
    assert float(reader[5, 0, 3].sum()) == 1.5 * reader.shape[-1]
    reader[7, 0, 0].fill_(-2.0)
    assert float(source[7, 0, 0, 0]) == -2.0
    descriptor = buffers.layout_descriptor()["layers"]
    json.dumps(descriptor)
    assert descriptor["model.layers.3"]["kv_source"] == "model.layers.2"
    assert (
        descriptor["model.layers.3"]["byte_offset"] == descriptor["model.layers.2"]["byte_offset"]
    )
    assert descriptor["model.layers.2"]["kv_source"] is None
    # The window layers' one-layer groups share the pool slot by slot with the full layer's.
    twins = {"model.layers.0", "model.layers.1"}
    assert set(descriptor["model.layers.2"]["aliases"]) == twins | {
        "model.layers.3",
        "model.layers.4",
    }
    assert set(plan.aliased_layers("model.layers.4")) == twins | {
        "model.layers.2",
        "model.layers.3",
    }
    assert plan.cache_group_of("model.layers.4") == plan.group_of("model.layers.2")
    # A slot twin's readers overlay the twin's bytes: layer 0's aliases name them too.
    assert set(plan.aliased_layers("model.layers.0")) == {
        "model.layers.1",
        "model.layers.2",
        "model.layers.3",
        "model.layers.4",
    }
    assert set(descriptor["model.layers.0"]["aliases"]) == set(
        plan.aliased_layers("model.layers.0")
    )
    # Views (readers' too) share bytes exactly where the plan says they alias.
    assert_views_sound(plan)


def test_kernel_split_and_host_tier_views_alias_too(tmp_path) -> None:
    plan = plan_kv_cache(
        yoco(n_self=1, n_cross=1),
        1 << 22,
        SMALL,
        manager_with_test_kinds(),
        host_offload_bytes=1 << 20,
    )
    group = plan.cache_group_of("model.layers.2").id
    buffers = materialize(plan, kernel_block_sizes={group: 8})
    assert buffers.views["model.layers.2"].shape == buffers.views["model.layers.1"].shape
    assert buffers.views["model.layers.2"].shape[0] == 2 * plan.pools[0].num_blocks
    host = buffers.tiers["host"].views
    assert host["model.layers.2"].data_ptr() == host["model.layers.1"].data_ptr()


def test_a_chain_of_readers_reads_the_layer_holding_the_cache() -> None:
    specs = layers([full(), full()])
    specs["model.layers.2"] = reads("model.layers.1", full())
    specs["model.layers.3"] = reads("model.layers.2", full())
    plan = plan_kv_cache(specs, 1 << 24, SMALL, manager_with_test_kinds())
    assert plan.kv_sharing == (
        ("model.layers.2", "model.layers.1"),
        ("model.layers.3", "model.layers.1"),
    )
    buffers = materialize(plan)
    assert buffers.views["model.layers.3"].data_ptr() == buffers.views["model.layers.1"].data_ptr()


def _refusal(specs: dict[str, KVSpec]) -> str:
    with pytest.raises(PlanError) as caught:
        plan_kv_cache(specs, 1 << 24, SMALL, manager_with_test_kinds())
    return str(caught.value)


def test_a_target_that_is_not_planned_is_refused() -> None:
    specs = layers([full()])
    specs["model.layers.1"] = reads("model.layers.9", full())
    message = _refusal(specs)
    assert "layer model.layers.1 reads the KV cache of layer 'model.layers.9'" in message
    assert "'target_layer'" in message and "not among the planned layers" in message
    assert "name an earlier layer" in message


def test_a_cycle_is_refused_naming_it() -> None:
    specs = layers([full()])
    specs["model.layers.1"] = reads("model.layers.2", full())
    specs["model.layers.2"] = reads("model.layers.1", full())
    message = _refusal(specs)
    assert "model.layers.1 -> model.layers.2 -> model.layers.1" in message
    assert "cycle" in message and "'target_layer'" in message
    assert "give one of them a cache of its own" in message
    specs = layers([full()])
    specs["model.layers.1"] = reads("model.layers.1", full())
    assert "model.layers.1 -> model.layers.1" in _refusal(specs)


def test_a_later_target_is_refused() -> None:
    specs = {"model.layers.0": reads("model.layers.1", full()), "model.layers.1": full()}
    message = _refusal(specs)
    assert "comes after it in model order" in message and "'target_layer'" in message


def test_a_target_of_another_shape_is_refused_naming_the_field() -> None:
    specs = layers([full()])
    specs["model.layers.1"] = reads("model.layers.0", full(num_kv_heads=4))
    message = _refusal(specs)
    assert "layer model.layers.1 cannot read the KV cache of layer model.layers.0" in message
    assert "'num_kv_heads' differs" in message
    assert "read a layer of the same attention type" in message
    # The group-merge advice is no fix for a reader: it reads its source's blocks or none.
    assert "separate groups" not in message and "share one KV cache group" not in message
    specs["model.layers.1"] = reads("model.layers.0", full(block_size=32))
    message = _refusal(specs)
    assert "field 'block_size' differs (16 in model.layers.0; 32 in model.layers.1)" in message
    assert "separate groups" not in message


def test_a_target_of_another_family_is_refused() -> None:
    specs = layers([window(64)])
    specs["model.layers.1"] = reads("model.layers.0", full())
    message = _refusal(specs)
    assert "its reader_spec is a FullAttentionSpec" in message
    assert "holds a WindowSpec cache" in message
    # The same family with another window would read blocks its source has freed.
    specs["model.layers.1"] = reads("model.layers.0", window(128))
    assert "'window' differs" in _refusal(specs)


def test_a_target_holding_no_cache_is_refused() -> None:
    encoder = EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    specs = layers([full(), encoder])
    specs["model.layers.2"] = reads("model.layers.1", encoder)
    message = _refusal(specs)
    assert "layer model.layers.1 holds none" in message and "'target_layer'" in message


def test_bad_sharing_specs_are_refused_at_construction() -> None:
    with pytest.raises(InvalidFieldTypeError, match="target_layer"):
        KVSharingSpec(target_layer="", reader_spec=full())
    with pytest.raises(InvalidFieldTypeError, match="reader_spec"):
        KVSharingSpec(target_layer="a", reader_spec="full")  # type: ignore[arg-type]
    with pytest.raises(InvalidFieldError, match="not another KVSharingSpec"):
        KVSharingSpec(target_layer="a", reader_spec=reads("b", full()))
    with pytest.raises(InvalidFieldError, match=re.escape("reader_spec.block_size (16)")):
        KVSharingSpec(target_layer="a", reader_spec=full(), block_size=32)


def test_plan_round_trips_and_edits_of_kv_sharing_are_refused() -> None:
    manager = manager_with_test_kinds()
    plan = plan_kv_cache(yoco(n_self=2, n_cross=2), 1 << 24, SMALL, manager)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["kv_sharing"] == [
        {"layer": "model.layers.3", "source": "model.layers.2"},
        {"layer": "model.layers.4", "source": "model.layers.2"},
    ]
    assert plan_from_dict(data, manager) == plan
    edited = json.loads(json.dumps(data))
    edited["kv_sharing"][1]["source"] = "model.layers.1"
    with pytest.raises(ConfigError, match="'kv_sharing' was edited"):
        plan_from_dict(edited, manager)
    # A plan written before sharing existed has no key and no reader.
    old = plan_kv_cache(layers([full()]), 1 << 24, SMALL, manager)
    old_data = old.to_dict()
    assert old_data["kv_sharing"] == [] and "kv_sharing" not in old_data["input_checksums"]
    del old_data["kv_sharing"]
    assert plan_from_dict(old_data, manager) == old


def test_a_plan_whose_reader_is_not_memoryless_is_refused() -> None:
    manager = manager_with_test_kinds()
    plan = plan_kv_cache(yoco(n_self=2, n_cross=1), 1 << 24, SMALL, manager)
    forged = attrs.evolve(plan, kv_sharing=(("model.layers.1", "model.layers.2"),))
    with pytest.raises(PlanError, match="must be a memoryless layer") as caught:
        reconcile_plans([forged])
    assert str(caught.value).endswith("re-plan instead of editing a plan")
    forged = attrs.evolve(plan, kv_sharing=(("model.layers.3", "model.layers.9"),))
    with pytest.raises(PlanError, match="holds no blocks in this plan") as caught:
        reconcile_plans([forged])
    assert str(caught.value).endswith("re-plan instead of editing a plan")


def test_workers_disagreeing_on_sharing_are_refused() -> None:
    manager = manager_with_test_kinds()
    specs = yoco(n_self=2, n_cross=1)
    plan = plan_kv_cache(specs, 1 << 24, SMALL, manager)
    other_specs = {**specs, "model.layers.3": EncoderOnlyAttentionSpec(**_full_fields())}
    other = plan_kv_cache(other_specs, 1 << 24, SMALL, manager)
    with pytest.raises(PlanError, match="reading another layer's cache differ"):
        reconcile_plans([plan, other])


def _full_fields() -> dict[str, object]:
    return dict(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hybrid_models(), st.data())
def test_readers_change_nothing_but_their_own_views(specs, data) -> None:
    """Adding layers that read any of a random hybrid model's cache-holding layers leaves
    groups, pools, tensors and figures unchanged, and each reader views its source."""
    manager = manager_with_test_kinds()
    ctx = SizingContext(max_model_len=32, max_in_flight_tokens=4)
    budget, host = 1 << 22, 1 << 22
    alone = plan_kv_cache(specs, budget, ctx, manager, host_budget_bytes=host)
    holding = [layer for group in alone.groups for layer in group.layers]
    targets = data.draw(st.lists(st.sampled_from(holding), min_size=1, max_size=4))
    shared = dict(specs)
    for index, target in enumerate(targets):
        shared[f"reader.{index}"] = reads(target, specs[target])
    plan = plan_kv_cache(shared, budget, ctx, manager, host_budget_bytes=host)
    assert (plan.groups, plan.pools, plan.tensors) == (alone.groups, alone.pools, alone.tensors)
    assert plan.max_concurrency == alone.max_concurrency
    assert plan.bytes_allocated == alone.bytes_allocated
    assert plan.memoryless_layers == (
        *alone.memoryless_layers,
        *(f"reader.{i}" for i in range(len(targets))),
    )
    buffers = materialize(plan)
    for index, target in enumerate(targets):
        reader = buffers.views[f"reader.{index}"]
        source = buffers.views[target]
        assert reader.data_ptr() == source.data_ptr()
        assert (reader.shape, reader.stride()) == (source.shape, source.stride())


def test_a_long_chain_of_readers_is_resolved_in_linear_time() -> None:
    """Each hop is walked once: 3,000 readers each reading the previous one plan in well
    under a second of CPU (walking every chain from its start took minutes)."""
    specs: dict[str, KVSpec] = {"model.layers.0": full(**TINY)}
    for index in range(1, 3001):
        specs[f"model.layers.{index}"] = reads(f"model.layers.{index - 1}", full(**TINY))
    started = time.process_time()
    plan = plan_kv_cache(specs, 1 << 20, SMALL, manager_with_test_kinds())
    assert time.process_time() - started < 10
    assert {source for _, source in plan.kv_sharing} == {"model.layers.0"}
    assert len(plan.kv_sharing) == 3000
