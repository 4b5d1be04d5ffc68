"""Workers agree on one plan: reconcile_plans, and two gloo ranks on CPU."""

from __future__ import annotations

import json
import socket

import pytest
import torch.multiprocessing as mp
from planner_testkit import (
    StateSpec,
    agreement_worker,
    full,
    layers,
    plan_kv_with_budget,
)

from kvspec_core import SizingContext
from kvspec_core.errors import PlanError
from kvspec_core.planner import reconcile_plans

CTX = SizingContext(max_model_len=64)


def _specs(head: int = 8) -> dict:
    state = StateSpec(block_size=4, state_bytes=1000)
    return layers(
        [
            full(num_kv_heads=2, head_size=8, block_size=4),
            state,
            full(num_kv_heads=2, head_size=head, block_size=4),
            state,
        ]
    )


def test_reconcile_takes_the_smallest_pool_of_each_plan() -> None:
    plans = [plan_kv_with_budget(_specs(), budget, CTX) for budget in (96 << 10, 200 << 10)]
    agreed = reconcile_plans(plans)
    assert [p.num_blocks for p in agreed.pools] == [
        min(plan.pools[i].num_blocks for plan in plans) for i in range(2)
    ]
    assert agreed.groups == plans[0].groups
    assert agreed.bytes_allocated <= min(plan.budget_bytes for plan in plans)
    assert reconcile_plans([plans[1]]) == plans[1]


def test_reconcile_refuses_different_specs_naming_the_layer() -> None:
    plans = [
        plan_kv_with_budget(_specs(8), 96 << 10, CTX),
        plan_kv_with_budget(_specs(16), 200 << 10, CTX),
    ]
    with pytest.raises(PlanError, match=r"plans 0 and 1 .* layer model\.layers\.2 has spec"):
        reconcile_plans(plans)
    with pytest.raises(PlanError, match="at least one plan"):
        reconcile_plans([])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_gloo_ranks_agree_on_the_minimum_and_refuse_a_mismatch(tmp_path) -> None:
    mp.spawn(agreement_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)

    def outcome(scenario: str, rank: int) -> dict:
        return json.loads((tmp_path / f"{scenario}{rank}.json").read_text())

    agreed = [outcome("agree", rank) for rank in range(2)]
    assert agreed[0]["plan"] == agreed[1]["plan"]
    expected = [min(a, b) for a, b in zip(agreed[0]["own"], agreed[1]["own"], strict=True)]
    assert agreed[0]["blocks"] == agreed[1]["blocks"] == expected
    assert agreed[0]["own"] != agreed[1]["own"]
    assert agreed[0]["plan"]["budget_bytes"] == 96 << 10
    for rank in range(2):
        refused = outcome("mismatch", rank)
        assert "ranks 0 and 1" in refused["error"]
        assert "layer model.layers.2" in refused["error"]
    # Found in review: each rank kept its own host tier, so tier block ids the scheduler
    # handed out did not exist on the smaller rank.
    tiered = [outcome("tiers", rank) for rank in range(2)]
    assert tiered[0]["own_tiers"] != tiered[1]["own_tiers"]
    assert tiered[0]["tiers"] == tiered[1]["tiers"] == tiered[1]["own_tiers"]
    assert tiered[0]["plan"] == tiered[1]["plan"]


def test_reconcile_sizes_each_tier_from_its_smallest_budget_and_refuses_other_tiers(
    tmp_path,
) -> None:
    big, small = (
        plan_kv_with_budget(_specs(), 96 << 10, CTX, host_offload_bytes=host)
        for host in (512 << 10, 128 << 10)
    )
    assert big.tiers[0].blocks_per_pool != small.tiers[0].blocks_per_pool
    for order in ([big, small], [small, big]):
        agreed = reconcile_plans(order)
        assert agreed.tiers == small.tiers
    untiered = plan_kv_with_budget(_specs(), 96 << 10, CTX)
    for order in ([big, untiered], [untiered, big]):
        with pytest.raises(PlanError, match="offload tiers differ"):
            reconcile_plans(order)
    # A disk tier is sized alike everywhere but keeps the first plan's own folder.
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
    disks = [
        plan_kv_with_budget(_specs(), 96 << 10, CTX, disk_offload_bytes=size, disk_path=str(folder))
        for size, folder in zip((512 << 10, 128 << 10), folders, strict=True)
    ]
    agreed = reconcile_plans(disks)
    assert agreed.tiers[0].blocks_per_pool == disks[1].tiers[0].blocks_per_pool
    assert agreed.tiers[0].path == str(folders[0])


def test_reconcile_refuses_plans_whose_layers_sit_in_other_slots() -> None:
    specs = layers([full(num_kv_heads=2, head_size=8, block_size=4)] * 3)
    reordered = dict(reversed(list(specs.items())))
    plans = [
        plan_kv_with_budget(specs, 96 << 10, CTX),
        plan_kv_with_budget(reordered, 96 << 10, CTX),
    ]
    assert plans[0].groups[0].layers != plans[1].groups[0].layers
    with pytest.raises(
        PlanError,
        match=r"plans 0 and 1 .* layer model\.layers\.0 is at slot 0 "
        "of group 0 vs slot 2",
    ):
        reconcile_plans(plans)


def test_rebuild_refuses_block_counts_that_do_not_match_the_pools() -> None:
    from kvspec_core.planner.planner import rebuild_with_blocks

    plan = plan_kv_with_budget(_specs(), 96 << 10, CTX)
    counts = [pool.num_blocks for pool in plan.pools]
    with pytest.raises(PlanError, match=r"2 pools.*got 1 block count"):
        rebuild_with_blocks(plan, counts[:1])
    with pytest.raises(PlanError, match=r"2 pools.*got 3 block count"):
        rebuild_with_blocks(plan, [*counts, 9])
    with pytest.raises(PlanError, match="block count of pool 0"):
        rebuild_with_blocks(plan, [float(counts[0]), counts[1]])  # type: ignore[list-item]
    with pytest.raises(PlanError, match=r"reconcile_plans.*KVCachePlan"):
        reconcile_plans([plan, plan.to_dict()])  # type: ignore[list-item]
