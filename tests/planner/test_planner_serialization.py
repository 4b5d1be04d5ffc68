"""Plans as plain data: JSON round trip, engine-neutral keys."""

from __future__ import annotations

import json
import re

import pytest
import torch
from planner_testkit import (
    HostSpec,
    RawSpec,
    StateSpec,
    full,
    gpt_oss_20b,
    layers,
    manager_with_test_kinds,
    window,
)

from kvspec_core import ConfigError, SizingContext
from kvspec_core.errors import PlanError
from kvspec_core.planner import KVCachePlan, materialize, plan_from_dict, plan_kv_cache

CTX = SizingContext(max_model_len=2048, max_in_flight_tokens=512)


def _plans() -> list[KVCachePlan]:
    manager = manager_with_test_kinds()
    state = StateSpec(block_size=16, state_bytes=3000)
    host = HostSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    return [
        plan_kv_cache(gpt_oss_20b(), 256 << 20, CTX, manager),
        plan_kv_cache(
            layers(
                [full(num_kv_heads=8), full(num_kv_heads=2, page_size_padded=16 * 2 * 256 * 2 + 64)]
            ),
            64 << 20,
            CTX,
            manager,
            layout="BLHNC",
        ),
        plan_kv_cache(
            layers(
                [full(), state, window(64), state, RawSpec(block_size=16, page_bytes=512), host]
            ),
            128 << 20,
            CTX,
            manager,
            layout="LHBNC",
            host_budget_bytes=8 << 20,
        ),
    ]


def test_json_round_trip_is_equal() -> None:
    manager = manager_with_test_kinds()
    for plan in _plans():
        text = json.dumps(plan.to_dict())
        again = plan_from_dict(json.loads(text), manager)
        assert again == plan
        assert json.dumps(again.to_dict()) == text


def test_plan_dict_has_the_cli_contract_keys() -> None:
    data = _plans()[0].to_dict()
    for key in (
        "num_blocks",
        "groups",
        "bytes_allocated",
        "bytes_padding",
        "max_concurrency",
        "budget_bytes",
        "pools",
        "tensors",
        "needs_zeroing",
        "has_mixed_precision",
        "transfer_group_ids",
        "host_group_ids",
        "aliases",
    ):
        assert key in data
    for group in data["groups"]:
        for key in (
            "kind",
            "layers",
            "block_size",
            "page_size_bytes",
            "pool",
            "blocks_per_request",
            "host_resident",
            "role",
            "transferable",
        ):
            assert key in group
    assert data["groups"][0]["page_size_bytes"] == 12 * 16 * 8 * 128 * 2


def test_reloaded_plan_materialises_the_same_layout() -> None:
    plan = _plans()[2]
    again = plan_from_dict(json.loads(json.dumps(plan.to_dict())), manager_with_test_kinds())
    assert materialize(again).layout_descriptor() == materialize(plan).layout_descriptor()
    json.dumps(materialize(plan).layout_descriptor())


def test_malformed_plans_are_refused() -> None:
    data = _plans()[0].to_dict()
    with pytest.raises(ConfigError, match="format_version"):
        plan_from_dict({**data, "format_version": 99}, manager_with_test_kinds())
    broken = dict(data)
    del broken["pools"]
    with pytest.raises(ConfigError, match="pools"):
        plan_from_dict(broken, manager_with_test_kinds())


def test_transfer_facts_follow_the_groups() -> None:
    plan = _plans()[2]  # full, state, window, state, raw, host (not transferable)
    host_gid = plan.group_of("model.layers.5").id
    assert host_gid not in plan.transfer_group_ids
    index = plan.transfer_group_index_by_layer
    assert "model.layers.5" not in index
    assert index["model.layers.0"] == plan.transfer_group_ids.index(
        plan.group_of("model.layers.0").id
    )
    ids = [[gid * 10] for gid in range(len(plan.groups))]
    assert plan.select_transfer_block_ids(ids) == tuple(
        [gid * 10] for gid in plan.transfer_group_ids
    )
    with pytest.raises(PlanError, match="expected block ids for"):
        plan.select_transfer_block_ids(ids[:-1])
    for tensor in plan.tensors:
        assert plan.num_blocks_of(tensor) * plan.pools[tensor.pool].block_bytes == tensor.size


def test_edited_plans_are_refused_as_inconsistent() -> None:
    data = json.loads(json.dumps(_plans()[0].to_dict()))
    data["tensors"][0]["offset"] += 4096
    with pytest.raises(ConfigError, match="field 'tensors'"):
        plan_from_dict(data, manager_with_test_kinds())
    data = json.loads(json.dumps(_plans()[0].to_dict()))
    data["pools"][0]["num_blocks"] = "many"
    with pytest.raises(ConfigError):
        plan_from_dict(data, manager_with_test_kinds())
    data = json.loads(json.dumps(_plans()[0].to_dict()))
    data["pools"][0]["num_blocks"] = 1
    with pytest.raises(ConfigError, match="inconsistent"):
        plan_from_dict(data, manager_with_test_kinds())


@pytest.mark.parametrize(
    "edit",
    [
        lambda data: data["groups"][0].update(kind="full_attention_but_edited"),
        lambda data: data["pools"][0].update(num_blocks=float(data["pools"][0]["num_blocks"])),
        lambda data: data.update(budget_bytes=float(data["budget_bytes"])),
        lambda data: data["tensors"][0].update(raw=0),
    ],
)
def test_edited_kinds_and_non_int_counts_are_refused(edit) -> None:
    data = json.loads(json.dumps(_plans()[0].to_dict()))
    edit(data)
    with pytest.raises(ConfigError):
        plan_from_dict(data, manager_with_test_kinds())


def test_from_dict_names_a_missing_manager() -> None:
    from kvspec_core.errors import InvalidFieldTypeError

    with pytest.raises(InvalidFieldTypeError, match=re.escape("from_dict.manager")):
        plan_from_dict(_plans()[0].to_dict(), None)  # type: ignore[arg-type]


def test_fixed_blocks_round_trip_and_older_documents_derive_them() -> None:
    """A Mamba state pool's blocks are all fixed (held whatever a request's length): the
    plan writes them per pool; a document written before they were told apart derives them
    from its groups' specs and loads as the same plan; an edited count is refused."""
    mamba = pytest.importorskip("kvspec_mamba")
    from kvspec_core import PluginManager

    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "mamba"})
    state = mamba.MambaSpec(
        block_size=16, shapes=((3, 512), (8, 64, 16)), dtypes=(torch.bfloat16, torch.float32)
    )
    ctx = SizingContext(max_model_len=2048, mamba_cache_mode="align")
    plan = plan_kv_cache(layers([full(), state, state, full()]), 64 << 20, ctx, manager)
    document = plan.to_dict()
    fixed = {pool["id"]: pool["fixed_blocks_per_request"] for pool in document["pools"]}
    demands = {pool["id"]: pool["blocks_per_request"] for pool in document["pools"]}
    state_pool = next(group.pool for group in plan.groups if group.kind == "mamba")
    assert fixed[state_pool] == demands[state_pool] > 0
    assert sum(fixed.values()) == fixed[state_pool]
    assert plan_from_dict(json.loads(json.dumps(document)), manager) == plan
    older = json.loads(json.dumps(document))
    for pool in older["pools"]:
        del pool["fixed_blocks_per_request"]
    assert plan_from_dict(older, manager) == plan
    edited = json.loads(json.dumps(document))
    edited["pools"][state_pool]["fixed_blocks_per_request"] = 0
    with pytest.raises(ConfigError, match="pools"):
        plan_from_dict(edited, manager)
