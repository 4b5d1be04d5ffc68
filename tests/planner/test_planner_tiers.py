"""Offload tiers in the plan: sized per pool by the device split, serialised, refused when bad."""

from __future__ import annotations

import os
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from planner_testkit import GiB, HostSpec, full, layers, manager_with_test_kinds

from kvspec_core import SizingContext, load_plugins
from kvspec_core.errors import ConfigError, InvalidFieldError, InvalidFieldTypeError
from kvspec_core.models.catalog import resolve_model
from kvspec_core.models.normalized import normalize_config
from kvspec_core.models.planning import prepare_model
from kvspec_core.planner import KVCachePlan, plan_from_dict, plan_kv_cache, reconcile_plans
from kvspec_core.planner.budget import blocks_for, pool_concurrency, split_budget
from kvspec_core.planner.plan_writing import input_checksums
from kvspec_core.planner.tiers import OffloadTierError
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

TiB = 1 << 40


def _preset_plan(
    name: str, manager: PluginManager, max_model_len: int | None = None, **tiers: Any
) -> KVCachePlan:
    """``name``'s plan at 40 GiB with the real plugins, as ``kvspec plan`` makes it."""
    config = normalize_config(resolve_model(name).config)
    prepared = prepare_model(config, PlanOptions(), manager, name=name, max_model_len=max_model_len)
    return plan_kv_cache(prepared.specs, 40 * GiB, prepared.context, manager, **tiers)


def _excess_bytes_bounded(
    blocks: list[int], demands: list[int], block_bytes: list[int], fixed: list[int] | None = None
) -> None:
    """Every pool's usable blocks are what the concurrency (the least over pools) needs,
    give or take what whole blocks leave over: at most two blocks of every pool, in bytes,
    and where pools hold fixed blocks (whole for each request begun) what one more
    request's fixed blocks would cost (the leftover that cannot buy them)."""
    fixed = fixed or [0] * len(blocks)
    parts = list(zip(blocks, demands, fixed, strict=True))
    concurrency = min(pool_concurrency(*part) for part in parts)
    slack = 2 * sum(block_bytes) + sum(f * size for f, size in zip(fixed, block_bytes, strict=True))
    for (count, demand, part), size in zip(parts, block_bytes, strict=True):
        assert 0 <= (count - blocks_for(concurrency, demand, part)) * size <= slack


PRESETS = [
    ("llama-3.1-8b", None),
    ("gemma-2-9b", None),
    ("gpt-oss-20b", None),
    ("jamba-1.5-mini", None),
    ("nemotron-h-56b", 8192),
]


@pytest.mark.parametrize(("name", "max_model_len"), PRESETS)
def test_each_tier_splits_its_budget_like_the_device(
    name: str, max_model_len: int | None, tmp_path: Path
) -> None:
    plan = _preset_plan(
        name,
        load_plugins(),
        max_model_len,
        host_offload_bytes=256 * GiB,
        disk_offload_bytes=2 * TiB,
        disk_path=str(tmp_path),
    )
    assert [tier.name for tier in plan.tiers] == ["host", "disk"]
    host, disk = plan.tiers
    assert (host.budget_bytes, host.path) == (256 * GiB, None)
    assert (disk.budget_bytes, disk.path) == (2 * TiB, str(tmp_path))
    demands = [pool.blocks_per_request for pool in plan.pools]
    block_bytes = [pool.block_bytes for pool in plan.pools]
    device = [pool.num_blocks for pool in plan.pools]
    _excess_bytes_bounded(
        device, demands, block_bytes, [pool.fixed_blocks_per_request for pool in plan.pools]
    )
    # Tiers cache prefixes of any length: split in proportion to demand, fixed blocks or not.
    proportional = split_budget(demands, block_bytes, plan.budget_bytes)
    assert proportional is not None
    device_concurrency = min(Fraction(n - 1, d) for n, d in zip(proportional, demands, strict=True))
    for tier in plan.tiers:
        blocks = list(tier.blocks_per_pool)
        used = sum(n * b for n, b in zip(blocks, block_bytes, strict=True))
        assert tier.bytes_allocated == used <= tier.budget_bytes
        assert tier.budget_bytes - used < min(block_bytes)  # no further block fits
        assert all(count >= 2 for count in blocks)
        # The device's proportions: tokens per pool follow demand as on the device.
        _excess_bytes_bounded(blocks, demands, block_bytes)
        # Beyond null blocks, the tier holds budget-ratio times the device's requests.
        ratio = Fraction(tier.budget_bytes - sum(block_bytes), plan.budget_bytes - sum(block_bytes))
        tier_concurrency = min(Fraction(n - 1, d) for n, d in zip(blocks, demands, strict=True))
        assert abs(tier_concurrency / device_concurrency / ratio - 1) < 0.01


def test_single_pool_tiers_are_budget_over_block_bytes(tmp_path: Path) -> None:
    plan = _preset_plan(
        "llama-3.1-8b",
        load_plugins(),
        host_offload_bytes=256 * GiB,
        disk_offload_bytes=2 * TiB,
        disk_path=str(tmp_path),
    )
    block = plan.pools[0].block_bytes
    assert block == 2 << 20
    assert plan.tier("host") is not None and plan.tier("host").blocks_per_pool == (131072,)
    assert plan.tier("disk") is not None and plan.tier("disk").blocks_per_pool == (1048576,)
    assert plan.pools[0].num_blocks == 20480  # the device plan is unchanged


def test_hybrid_figures(tmp_path: Path) -> None:
    """Jamba at 40 GiB + 256 GiB host: the Mamba pool and the attention pool each hold
    about 6.4x their device blocks (256/40), as on the device, pinned here."""
    plan = _preset_plan("jamba-1.5-mini", load_plugins(), host_offload_bytes=256 * GiB)
    assert [pool.num_blocks for pool in plan.pools] == [141, 163170]
    assert plan.tiers[0].blocks_per_pool == (894, 1044329)
    assert plan.tier("disk") is None


def test_no_tiers_asked_means_none() -> None:
    plan = _preset_plan("llama-3.1-8b", load_plugins())
    assert plan.tiers == () and plan.to_dict()["tiers"] == []


def test_host_resident_pools_get_no_tier_blocks() -> None:
    host = HostSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    specs = layers([full(), host])
    plan = plan_kv_cache(
        specs,
        64 << 20,
        SizingContext(max_model_len=4096),
        manager_with_test_kinds(),
        host_budget_bytes=8 << 20,
        host_offload_bytes=32 << 20,
    )
    host_pools = [pool.id for pool in plan.pools if pool.host_resident]
    assert host_pools
    (tier,) = plan.tiers
    for pool in plan.pools:
        assert (tier.blocks_per_pool[pool.id] == 0) == pool.host_resident
    # The host tier is its own budget, beside the host-resident pools'.
    assert tier.bytes_allocated <= 32 << 20 and plan.host_bytes_allocated <= 8 << 20


# ----------------------------------------------------------------- the JSON document
def _tiered_plan(tmp_path: Path, manager: PluginManager) -> KVCachePlan:
    return _preset_plan(
        "gemma-2-9b",
        manager,
        host_offload_bytes=64 * GiB,
        disk_offload_bytes=1 * TiB,
        disk_path=str(tmp_path),
    )


def test_json_round_trip_keeps_the_tiers(tmp_path: Path) -> None:
    manager = load_plugins()
    plan = _tiered_plan(tmp_path, manager)
    data = plan.to_dict()
    assert data["tiers"] == [
        {
            "name": tier.name,
            "budget_bytes": tier.budget_bytes,
            "path": tier.path,
            "blocks_per_pool": list(tier.blocks_per_pool),
            "bytes_allocated": tier.bytes_allocated,
        }
        for tier in plan.tiers
    ]
    assert "tiers" in data["input_checksums"]
    assert plan_from_dict(data, manager) == plan
    # Read where the directory does not exist: the plan is data, not a claim on the disk.
    os.rmdir(tmp_path)
    assert plan_from_dict(data, manager) == plan


def test_a_plan_written_before_tiers_loads_with_none() -> None:
    manager = load_plugins()
    data = _preset_plan("gemma-2-9b", manager).to_dict()
    del data["tiers"]
    assert "tiers" not in data["input_checksums"]
    assert plan_from_dict(data, manager).tiers == ()


def _resign(data: dict[str, Any]) -> None:
    """Write fresh input checksums, as a careless editor could."""
    data["input_checksums"] = input_checksums(data)


@pytest.mark.parametrize(
    ("edit", "resign", "field"),
    [
        (lambda d: d["tiers"][0]["blocks_per_pool"].__setitem__(0, 5), False, "tiers"),
        (lambda d: d["tiers"][0]["blocks_per_pool"].__setitem__(0, 5), True, "tiers"),
        (
            lambda d: d["tiers"][0].update(budget_bytes=d["tiers"][0]["budget_bytes"] * 2),
            True,
            "tiers",
        ),
        (lambda d: d["tiers"][1].update(bytes_allocated=1), True, "tiers"),
        (lambda d: d["tiers"].pop(), False, "tiers"),
        (lambda d: d["tiers"][1].update(path=None), True, "tiers[1].path"),
        (lambda d: d["tiers"][1].update(path="relative/dir"), True, "tiers[1].path"),
        (lambda d: d["tiers"][0].update(path="/tmp"), True, "tiers[0].path"),
        (lambda d: d["tiers"].reverse(), True, "tiers"),
        (lambda d: d["tiers"][0].update(name="remote"), True, "tiers[0].name"),
        (lambda d: d["tiers"][0].update(budget_bytes=-1), True, "tiers[0].budget_bytes"),
        (lambda d: d["tiers"][0]["blocks_per_pool"].append(3), True, "tiers[0].blocks_per_pool"),
        (lambda d: d["tiers"][0].pop("path"), True, "tiers[0].path"),
        (lambda d: d["tiers"][0].update(extra=1), True, "tiers[0].extra"),
        (lambda d: d.update(tiers={}), True, "tiers"),
    ],
)
def test_edited_tiers_are_refused_naming_the_field(
    edit: Any, resign: bool, field: str, tmp_path: Path
) -> None:
    manager = load_plugins()
    data = _tiered_plan(tmp_path, manager).to_dict()
    edit(data)
    if resign:
        _resign(data)
    with pytest.raises(ConfigError, match=re.escape(f"'{field}")):
        plan_from_dict(data, manager)


def test_reconcile_keeps_the_tiers(tmp_path: Path) -> None:
    manager = load_plugins()
    plan = _tiered_plan(tmp_path, manager)
    assert reconcile_plans([plan, plan]).tiers == plan.tiers


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("arguments", "field", "error"),
    [
        ({"host_offload_bytes": -1}, "host_offload_bytes", InvalidFieldError),
        ({"host_offload_bytes": 0}, "host_offload_bytes", InvalidFieldError),
        ({"host_offload_bytes": 1.5}, "host_offload_bytes", InvalidFieldTypeError),
        ({"host_offload_bytes": True}, "host_offload_bytes", InvalidFieldTypeError),
        ({"disk_offload_bytes": 1 << 30}, "disk_path", InvalidFieldError),
        ({"disk_path": "/tmp"}, "disk_offload_bytes", InvalidFieldError),
        ({"disk_path": "", "disk_offload_bytes": 1 << 30}, "disk_path", InvalidFieldTypeError),
        ({"disk_path": 7, "disk_offload_bytes": 1 << 30}, "disk_path", InvalidFieldTypeError),
    ],
)
def test_bad_tier_arguments_name_the_argument(
    arguments: dict[str, Any], field: str, error: type[Exception]
) -> None:
    with pytest.raises(error, match=field):
        _preset_plan("llama-3.1-8b", load_plugins(), **arguments)


def test_disk_path_must_be_a_writable_directory(tmp_path: Path) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    for path in (file, tmp_path / "missing"):
        with pytest.raises(InvalidFieldError, match=r"disk_path.*existing directory"):
            _preset_plan(
                "llama-3.1-8b", load_plugins(), disk_offload_bytes=1 << 30, disk_path=str(path)
            )
    if os.geteuid() == 0:
        pytest.skip("root writes to read-only directories")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(InvalidFieldError, match=r"disk_path.*can write"):
        _preset_plan(
            "llama-3.1-8b", load_plugins(), disk_offload_bytes=1 << 30, disk_path=str(locked)
        )


def test_a_tier_too_small_for_one_block_of_each_pool_names_the_least_budget() -> None:
    manager = load_plugins()
    plan = _preset_plan("jamba-1.5-mini", manager)
    needed = 2 * sum(pool.block_bytes for pool in plan.pools)
    with pytest.raises(OffloadTierError, match=f"host_offload_bytes.*at least {needed} bytes"):
        _preset_plan("jamba-1.5-mini", manager, host_offload_bytes=needed - 1)
    tier = _preset_plan("jamba-1.5-mini", manager, host_offload_bytes=needed).tiers[0]
    assert tier.blocks_per_pool == (2, 2)


# ----------------------------------------------------------------- the split, any pools
_POOLS = st.lists(st.tuples(st.integers(1, 5000), st.integers(1, 1 << 20)), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(_POOLS, st.integers(0, 1 << 36))
def test_tier_split_invariants(pools: list[tuple[int, int]], budget: int) -> None:
    """A tier's split never exceeds its budget, leaves less than any block idle, keeps
    every pool's null block and follows demand as the device split does."""
    demands = [demand for demand, _ in pools]
    block_bytes = [size for _, size in pools]
    split = split_budget(demands, block_bytes, budget, require_one_request=False)
    if budget < sum(block_bytes):
        assert split is None
        return
    assert split is not None and all(count >= 1 for count in split)
    used = sum(n * b for n, b in zip(split, block_bytes, strict=True))
    assert used <= budget and budget - used < min(block_bytes)
    _excess_bytes_bounded(split, demands, block_bytes)
    if budget >= 2 * sum(block_bytes):
        assert all(count >= 2 for count in split)
    # Where one request fits, a tier splits exactly as the device does.
    device = split_budget(demands, block_bytes, budget)
    if device is not None:
        assert device == split
