"""materialize() gives the offload tiers host buffers and disk files whose views take whole
device blocks: the same per-block shape and strides, a copied block round-trips exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from planner_testkit import StateSpec, full, layers, manager_with_test_kinds, window

from kvspec_core import SizingContext
from kvspec_core.errors import ConfigError, InvalidFieldError, PlanError
from kvspec_core.planner import KVCachePlan, materialize, plan_kv_cache
from kvspec_core.planner.tier_buffers import tier_file_name
from kvspec_core.specs import FullAttentionSpec

CTX = SizingContext(max_model_len=1024, max_in_flight_tokens=256)


def _plan(layout: str, tmp_path: Path) -> KVCachePlan:
    """A hybrid of full attention, a window and a state pool, with both tiers."""
    small = {"num_kv_heads": 2, "head_size": 32}
    specs = layers(
        [
            full(**small),
            window(128, **small),
            StateSpec(block_size=16, state_bytes=3072),
            full(**small),
            window(128, **small),
        ]
    )
    return plan_kv_cache(
        specs,
        8 << 20,
        CTX,
        manager_with_test_kinds(),
        layout=layout,
        host_offload_bytes=5 << 20,
        disk_offload_bytes=6 << 20,
        disk_path=str(tmp_path),
    )


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"])
def test_tier_views_take_whole_device_blocks(layout: str, tmp_path: Path) -> None:
    plan = _plan(layout, tmp_path)
    assert len(plan.pools) == 2 and [t.name for t in plan.tiers] == ["host", "disk"]
    buffers = materialize(plan)
    generator = torch.Generator().manual_seed(0)
    for pool_buffer in buffers.buffers:
        pool_buffer.copy_(torch.randint(0, 256, pool_buffer.shape, generator=generator))
    original = [pool_buffer.clone() for pool_buffer in buffers.buffers]
    for tier in plan.tiers:
        tier_buffers = buffers.tiers[tier.name]
        for pool in plan.pools:
            count = tier.blocks_per_pool[pool.id]
            assert tier_buffers.buffers[pool.id].numel() == count * pool.block_bytes
        assert set(tier_buffers.views) == set(buffers.views)
        for name, device_view in buffers.views.items():
            tier_view = tier_buffers.views[name]
            pool = buffers.layer_views[name].pool
            assert tier_view.dtype == device_view.dtype
            assert tier_view.shape[0] == tier.blocks_per_pool[pool]
            assert tier_view[1].shape == device_view[1].shape
            if layout == "LHBNC":
                # Heads lie outside the block dim there: their stride spans the pool's
                # blocks, so it follows the block count; within a head, pages match.
                assert tier_view[1].stride()[1:] == device_view[1].stride()[1:]
            else:
                assert tier_view[1].stride() == device_view[1].stride()
        # Offload device block 3 of every layer to tier block 5, wipe it, load it back.
        for name, device_view in buffers.views.items():
            block = device_view.index_select(0, torch.tensor([3]))
            tier_buffers.views[name].index_copy_(0, torch.tensor([5]), block)
        for device_view in buffers.views.values():
            device_view[3].zero_()
        for name, device_view in buffers.views.items():
            block = tier_buffers.views[name].index_select(0, torch.tensor([5]))
            device_view.index_copy_(0, torch.tensor([3]), block)
        for pool_buffer, before in zip(buffers.buffers, original, strict=True):
            assert torch.equal(pool_buffer, before)


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC", "BLHNC"])
def test_block_byte_ranges_cover_exactly_the_views_bytes(layout: str, tmp_path: Path) -> None:
    """The runs of a tier block are exactly the bytes its pages occupy in the buffer."""
    plan = _plan(layout, tmp_path)
    tiers = materialize(plan).tiers
    for tier in tiers.values():
        for pool_id, pool_buffer in tier.buffers.items():
            pool_buffer.zero_()
            for name, view in tier.views.items():
                if tier.plan.groups[tier.plan.group_of(name).id].pool == pool_id:
                    view[2].view(torch.uint8).fill_(1)
            marked = pool_buffer.nonzero().flatten().tolist()
            runs = tier.block_byte_ranges(pool_id, 2)
            covered = [byte for start, length in runs for byte in range(start, start + length)]
            assert covered == marked
            if not tier.plan.layout.startswith("L"):
                block_bytes = plan.pools[pool_id].block_bytes
                assert runs == [(2 * block_bytes, block_bytes)]
        with pytest.raises(IndexError, match="no block"):
            tier.block_byte_ranges(0, plan.tiers[0].blocks_per_pool[0] + 10**6)


def test_disk_tier_files_hold_the_blocks(tmp_path: Path) -> None:
    plan = _plan("LBHNC", tmp_path)
    disk = materialize(plan).tiers["disk"]
    for pool in plan.pools:
        path = tmp_path / tier_file_name(pool.id)
        assert disk.files[pool.id] == str(path)
        assert path.stat().st_size == plan.tier("disk").blocks_per_pool[pool.id] * pool.block_bytes
    name = next(iter(disk.views))
    pool_id = plan.slot_of(name)[0]
    disk.views[name][1].view(torch.uint8).fill_(7)
    start, length = disk.block_byte_ranges(pool_id, 1)[0]
    with open(disk.files[pool_id], "rb") as file:
        file.seek(start)
        assert set(file.read(length)) == {7}


def test_existing_disk_files_are_refused_and_nothing_is_made(tmp_path: Path) -> None:
    plan = _plan("LBHNC", tmp_path)
    (tmp_path / tier_file_name(1)).write_bytes(b"someone else's cache")
    with pytest.raises(ConfigError, match="already exists"):
        materialize(plan)
    assert sorted(p.name for p in tmp_path.iterdir()) == [tier_file_name(1)]
    # Without the tiers, the device buffers alone.
    assert materialize(plan, offload_tiers=False).tiers == {}


def test_host_tier_is_pinned_only_with_cuda(tmp_path: Path) -> None:
    specs = layers([full(num_kv_heads=2, head_size=32)] * 2)
    plan = plan_kv_cache(specs, 8 << 20, CTX, manager_with_test_kinds(), host_offload_bytes=4 << 20)
    host = materialize(plan).tiers["host"]
    assert all(buffer.device.type == "cpu" for buffer in host.buffers.values())
    assert all(buffer.is_pinned() == torch.cuda.is_available() for buffer in host.buffers.values())


def test_tier_views_are_checked_on_meta_before_anything_is_made(tmp_path: Path) -> None:
    """Found in review: a tier's view offsets depend on its block count in layer-outer
    layouts, so a plan whose device views pass could fail on its tier, after the tier's
    memory was allocated and its disk file made (left behind: every retry refused)."""
    packed = FullAttentionSpec(
        block_size=1, num_kv_heads=1, head_size=1, dtype=torch.uint8, state_content_bytes=3
    )
    fp32 = FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=1, dtype=torch.float32)
    ctx = SizingContext(max_model_len=2, max_in_flight_tokens=1)
    plan = plan_kv_cache(
        {"l0": packed, "l1": fp32},
        88,
        ctx,
        manager_with_test_kinds(),
        layout="LBHNC",
        disk_offload_bytes=55,
        disk_path=str(tmp_path),
    )
    materialize(plan, offload_tiers=False)  # the device's views alone are fine
    with pytest.raises(PlanError, match=r"layer l1 \(disk\) cannot be viewed"):
        materialize(plan)
    assert list(tmp_path.iterdir()) == []


def test_a_failure_after_the_disk_files_were_made_removes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvspec_core.planner import tier_buffers

    plan = _plan("LBHNC", tmp_path)
    real = tier_buffers._block_runs
    calls: list[int] = []

    def fail_on_the_disk_tier(geometry: KVCachePlan, pool: int) -> object:
        calls.append(pool)  # the host tier's pools come first, then the disk tier's
        if len(calls) > len(plan.pools):
            assert sorted(path.name for path in tmp_path.iterdir()) == [
                tier_file_name(pool.id) for pool in plan.pools
            ]
            raise RuntimeError("injected after the files were made")
        return real(geometry, pool)

    monkeypatch.setattr(tier_buffers, "_block_runs", fail_on_the_disk_tier)
    with pytest.raises(RuntimeError, match="injected"):
        materialize(plan)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert materialize(_plan("LBHNC", tmp_path)).tiers["disk"].files  # the retry succeeds


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_a_cuda_device_this_torch_cannot_use_is_refused_naming_the_field(
    tmp_path: Path, device: str
) -> None:
    with pytest.raises(InvalidFieldError, match=r"materialize\.device=.*CUDA"):
        materialize(_plan("LBHNC", tmp_path), device)
    assert list(tmp_path.iterdir()) == []
