"""Materialising a plan's offload tiers: host buffers and disk files beside the device pools.

A tier's pool is laid out exactly as the device pool would be with the tier's block count
(the plan's own geometry, :func:`~kvspec_core.planner.assembly.assemble`), so each layer's
tier view has the device view's per-block shape and strides and a block moves between them
as whole pages: ``tier_view.index_copy_(0, tier_ids, device_view.index_select(0, ids))``.
The host tier is pinned memory when CUDA is available (plain CPU memory otherwise); the
disk tier is one file per pool under the tier's directory, memory-mapped with the same
views, and :meth:`TierBuffers.block_byte_ranges` gives where a block's bytes lie in the file
for plain reads and writes. Host-resident pools are not offloaded: they have no tier buffer.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence

import attrs
import torch

from kvspec_core.errors import ConfigError
from kvspec_core.planner.assembly import assemble
from kvspec_core.planner.layer_views import LayerView, make_view
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.plan_parts import PlannedTier
from kvspec_core.planner.skeleton import skeleton_of_plan
from kvspec_core.planner.tiers import check_disk_directory

#: A run of a block's bytes: ``(offset of block 0, length, stride between blocks)``.
ByteRun = tuple[int, int, int]


def tier_file_name(pool: int) -> str:
    """The name of the disk tier's file for ``pool`` under the tier's directory."""
    return f"kvspec-pool{pool}.kvblocks"


@attrs.frozen(eq=False)
class TierBuffers:
    """One offload tier's buffers, per pool, and per-layer views of them.

    Attributes:
        name: ``"host"`` or ``"disk"``.
        plan: the plan's geometry with the tier's block counts (its tensors place the
            tier's pages; ``plan.pools[p].num_blocks`` is the tier's block count).
        buffers: pool id -> ``uint8`` buffer of ``blocks x block_bytes`` bytes (the disk
            tier's map its file). Pools not offloaded have none.
        views: layer -> view shaped like the device view of the layer, block dim first.
        files: pool id -> the disk tier's file (empty for the host tier).
        runs: pool id -> the runs of block 0's bytes (see :meth:`block_byte_ranges`).
    """

    name: str
    plan: KVCachePlan
    buffers: dict[int, torch.Tensor]
    views: dict[str, torch.Tensor]
    files: dict[int, str]
    runs: dict[int, tuple[ByteRun, ...]]

    def block_byte_ranges(self, pool: int, block: int) -> list[tuple[int, int]]:
        """``(byte offset, length)`` of each run of tier block ``block`` of ``pool`` in its
        buffer or file, in order: one run for block-outer layouts, one per page run
        (slot, or head with LHBNC) for layer-outer ones."""
        count = self.plan.pools[pool].num_blocks
        if pool not in self.runs or not 0 <= block < count:
            raise IndexError(
                f"{self.name} tier has no block {block} of pool {pool} "
                f"(pools offloaded: {sorted(self.runs)}, {count} blocks)"
            )
        return [(start + block * stride, length) for start, length, stride in self.runs[pool]]

    def remove_files(self) -> None:
        """Delete the disk tier's files (a materialisation that failed after making them;
        nothing for the host tier)."""
        _remove(self.files.values())


def _remove(paths: Iterable[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def _pin() -> bool:
    return torch.cuda.is_available()


def tier_geometry(plan: KVCachePlan, tier: PlannedTier) -> KVCachePlan:
    """``plan``'s groups, pools and tensors placed for the tier's block counts (a pool not
    offloaded gets one placeholder block and no buffer)."""
    blocks = [count or 1 for count in tier.blocks_per_pool]
    kinds = [group.kind for group in plan.groups]
    size = sum(pool.block_bytes * count for pool, count in zip(plan.pools, blocks, strict=True))
    return assemble(skeleton_of_plan(plan), kinds, blocks, plan.context, size, None)


def _block_runs(geometry: KVCachePlan, pool: int) -> tuple[ByteRun, ...]:
    """Where block 0 of ``pool`` lies in the pool's buffer, as merged byte runs, each with
    the block stride that moves it to block ``b``. Groups sharing the pool alias the same
    slots, so their runs coincide and are counted once."""
    pieces: set[ByteRun] = set()
    for tensor in geometry.tensors:
        if tensor.pool != pool:
            continue
        _, _, *inner_shape = tensor.shape
        _, _, *inner_strides = tensor.strides
        # Page bytes are dense along the innermost dims that are contiguous.
        length = 1
        dims = list(zip(inner_shape, inner_strides, strict=True))
        while dims and dims[-1][1] == length:
            size, _ = dims.pop()
            length *= size
        starts = [0]
        for size, stride in dims:
            starts = [start + i * stride for start in starts for i in range(size)]
        for layer in range(tensor.shape[0]):
            base = tensor.offset + layer * tensor.layer_stride
            pieces.update((base + start, length, tensor.block_stride) for start in starts)
    merged: list[list[int]] = []
    for start, length, stride in sorted(pieces):
        if merged and merged[-1][2] == stride and merged[-1][0] + merged[-1][1] >= start:
            merged[-1][1] = max(merged[-1][1], start + length - merged[-1][0])
        else:
            merged.append([start, length, stride])
    return tuple((start, length, stride) for start, length, stride in merged)


def _disk_files(tier: PlannedTier, geometry: KVCachePlan) -> dict[int, str]:
    """The disk tier's files, checked before any is made: the directory must still be
    writable and no file may exist (it could be another process's cache)."""
    assert tier.path is not None  # a plan's disk tier always names its directory
    check_disk_directory("materialize", "disk tier path", tier.path)
    files = {
        pool.id: os.path.join(tier.path, tier_file_name(pool.id))
        for pool, count in zip(geometry.pools, tier.blocks_per_pool, strict=True)
        if count
    }
    for path in files.values():
        if os.path.lexists(path):
            raise ConfigError(
                f"the disk tier's file {path} already exists (another kvspec process's "
                "cache, or one left over); remove it, or give each process its own disk "
                "tier directory"
            )
    return files


def _map_files(files: Mapping[int, str], geometry: KVCachePlan) -> dict[int, torch.Tensor]:
    """Create each file at its pool's size (sparse) and map it; on failure remove them."""
    made: list[str] = []
    try:
        buffers = {}
        for pool_id, path in files.items():
            size = geometry.pools[pool_id].size_bytes
            with open(path, "xb") as file:
                made.append(path)
                file.truncate(size)
            buffers[pool_id] = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        return buffers
    except BaseException:
        _remove(made)
        raise


def materialize_tier(
    plan: KVCachePlan,
    tier: PlannedTier,
    geometry: KVCachePlan,
    views: Sequence[LayerView],
) -> TierBuffers:
    """Allocate ``tier`` of ``plan`` (host memory, or files under its directory) and view
    every offloaded layer as its device view is viewed: ``geometry`` is
    :func:`tier_geometry`'s, ``views`` :func:`plan_layer_views` of it (made once by the
    caller, which checks them before anything is allocated)."""
    layer_views = [view for view in views if tier.blocks_per_pool[view.pool]]
    offloaded = [pool for pool in geometry.pools if tier.blocks_per_pool[pool.id]]
    files: dict[int, str] = {}
    if tier.name == "disk":
        files = _disk_files(tier, geometry)
        buffers = _map_files(files, geometry)
    else:
        make = torch.zeros if plan.needs_zeroing else torch.empty
        buffers = {
            pool.id: make(pool.size_bytes, dtype=torch.uint8, pin_memory=_pin())
            for pool in offloaded
        }
    try:
        return TierBuffers(
            name=tier.name,
            plan=geometry,
            buffers=buffers,
            views={view.layer: make_view(buffers[view.pool], view) for view in layer_views},
            files=files,
            runs={pool.id: _block_runs(geometry, pool.id) for pool in offloaded},
        )
    except BaseException:
        _remove(files.values())
        raise
