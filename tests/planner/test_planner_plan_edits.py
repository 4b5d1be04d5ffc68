"""``plan_from_dict`` refuses a plan dict edited after ``to_dict`` wrote it, naming the field:
derived figures and flags (recomputed from the groups and block counts) and the plan's inputs
that nothing derives from (block counts, host budget, memoryless layers, context)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import pytest
import torch
from planner_testkit import HostSpec, full, layers, manager_with_test_kinds, window

from kvspec_core import ConfigError, SizingContext
from kvspec_core.errors import PlanError
from kvspec_core.planner import KVCachePlan, plan_from_dict, plan_kv_cache
from kvspec_core.planner.planner import rebuild_with_blocks
from kvspec_core.specs.encoder import EncoderOnlyAttentionSpec

CTX = SizingContext(max_model_len=2048, max_in_flight_tokens=512)
Edit = Callable[[dict[str, Any]], object]


def hybrid_plan_with_memoryless_and_host_layers() -> KVCachePlan:
    encoder = EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
    )
    host = HostSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    specs = layers([encoder, full(), window(64), full(), window(64), host])
    return plan_kv_cache(specs, 64 << 20, CTX, manager_with_test_kinds(), host_budget_bytes=8 << 20)


def written(plan: KVCachePlan) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(plan.to_dict()))
    return data


def refused_naming(data: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=rf"field '{field}'") as raised:
        plan_from_dict(data, manager_with_test_kinds())
    assert "re-plan instead of editing a plan" in str(raised.value)


def test_an_unedited_plan_reads_back_equal() -> None:
    plan = hybrid_plan_with_memoryless_and_host_layers()
    assert plan.memoryless_layers == ("model.layers.0",)
    assert any(pool.host_resident for pool in plan.pools)
    assert plan_from_dict(written(plan), manager_with_test_kinds()) == plan


def _set(path: str, value: object) -> Edit:
    """An edit setting ``data[a][b]...`` (``path`` ``a.b...``, numbers index lists)."""
    *parents, last = path.split(".")

    def edit(data: dict[str, Any]) -> None:
        target: Any = data
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(last) if last.isdigit() else last] = value

    return edit


EDITS: list[tuple[str, Edit, str]] = [
    ("total num_blocks", lambda d: d.update(num_blocks=d["num_blocks"] + 1), "num_blocks"),
    (
        "a pool's num_blocks",
        lambda d: d["pools"][0].update(num_blocks=d["pools"][0]["num_blocks"] - 1),
        "num_blocks",
    ),
    (
        "host_budget_bytes raised",
        lambda d: d.update(host_budget_bytes=d["host_budget_bytes"] * 2),
        "host_budget_bytes",
    ),
    ("host_budget_bytes removed", _set("host_budget_bytes", None), "host_budget_bytes"),
    ("memoryless layer dropped", _set("memoryless_layers", []), "memoryless_layers"),
    (
        "memoryless layer added",
        lambda d: d["memoryless_layers"].append("model.layers.99"),
        "memoryless_layers",
    ),
    (
        "memoryless layer also in a group",
        lambda d: d["memoryless_layers"].append("model.layers.1"),
        "memoryless_layers",
    ),
    (
        "group host_resident",
        lambda d: d["groups"][0].update(host_resident=True),
        r"groups\[0\].host_resident",
    ),
    (
        "group transferable",
        lambda d: d["groups"][0].update(transferable=False),
        r"groups\[0\].transferable",
    ),
    (
        "group prefix_cacheable",
        lambda d: d["groups"][0].update(prefix_cacheable=False),
        r"groups\[0\].prefix_cacheable",
    ),
    ("group role", _set("groups.0.role", "hisparse_source"), r"groups\[0\].role"),
    ("group block_size", _set("groups.0.block_size", 32), r"groups\[0\].block_size"),
    ("group page_size_bytes", _set("groups.0.page_size_bytes", 1), r"groups\[0\].page_size_bytes"),
    ("pool max_concurrency", _set("pools.0.max_concurrency", 1e9), r"pools\[0\].max_concurrency"),
    ("needs_zeroing", lambda d: d.update(needs_zeroing=not d["needs_zeroing"]), "needs_zeroing"),
    (
        "has_mixed_precision",
        lambda d: d.update(has_mixed_precision=not d["has_mixed_precision"]),
        "has_mixed_precision",
    ),
    ("host_group_ids", _set("host_group_ids", []), "host_group_ids"),
    ("transfer_group_ids", _set("transfer_group_ids", [0]), "transfer_group_ids"),
    ("context", _set("context.max_in_flight_tokens", 4096), "context"),
    (
        "a spec field no figure shows",
        _set("groups.0.spec.fields.block_stride_alignment", 1),
        r"groups\[0\].spec",
    ),
    (
        "a group's layers",
        _set("groups.0.layers", ["model.layers.3", "model.layers.1"]),
        r"groups\[0\].layers",
    ),
    ("unknown field", _set("notes", "hand edited"), "notes"),
]


@pytest.mark.parametrize(
    ("edit", "field"),
    [(edit, field) for _, edit, field in EDITS],
    ids=[name for name, _, _ in EDITS],
)
def test_an_edited_field_is_refused_naming_it(edit: Edit, field: str) -> None:
    data = written(hybrid_plan_with_memoryless_and_host_layers())
    edit(data)
    refused_naming(data, field)


def test_a_plan_rebuilt_with_other_block_counts_reads_back() -> None:
    plan = hybrid_plan_with_memoryless_and_host_layers()
    fewer = rebuild_with_blocks(plan, [pool.num_blocks - 1 for pool in plan.pools])
    assert plan_from_dict(written(fewer), manager_with_test_kinds()) == fewer


def _leaf_paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in _leaf_paths(item, (*path, key))]
    if isinstance(value, list) and value:
        return [p for index, item in enumerate(value) for p in _leaf_paths(item, (*path, index))]
    return [path]


def _changed(value: Any) -> Any:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return ["model.layers.7"]
    return 1


def test_every_single_field_edit_is_refused() -> None:
    """Each leaf of the document (every count, flag, name, stride), changed on its own."""
    plan = hybrid_plan_with_memoryless_and_host_layers()
    original = written(plan)
    paths = _leaf_paths(original)
    assert len(paths) > 100
    for path in paths:
        data = written(plan)
        target = data
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = _changed(target[path[-1]])
        with pytest.raises(ConfigError):
            plan_from_dict(data, manager_with_test_kinds())
            pytest.fail(f"an edit of {'.'.join(map(str, path))} was accepted")


def test_a_group_whose_layers_disagree_with_its_uniform_spec_is_refused() -> None:
    # Built by hand, not read back: page sizes would count the spec's three members while
    # the views laid out two layers (a silent wrong figure before this check).
    plan = plan_kv_cache(
        layers([full(), full(head_size=64, num_kv_heads=16), full()]),
        64 << 20,
        CTX,
        manager_with_test_kinds(),
    )
    (group,) = plan.groups
    with pytest.raises(PlanError, match=r"group 0: field 'layers' .*\(spec.layer_specs\)"):
        attrs.evolve(group, layers=group.layers[:2])
    with pytest.raises(PlanError, match=r"group 0: field 'layers'"):
        attrs.evolve(group, layers=tuple(reversed(group.layers)))
    assert attrs.evolve(group, layers=group.layers) == group
