"""Materialising a plan: one byte buffer per pool, one strided view per layer.

Every view is ``torch.as_strided`` over its pool's ``uint8`` buffer with exactly the plan's
offsets and strides, reinterpreted in the layer's ``view_dtype``. All views are first built
on the ``meta`` device, so a plan the layout cannot express is refused before any memory is
allocated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvspec_core.dtypes import dtype_name
from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.planner.layer_views import LayerView, make_view, plan_layer_views
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.tier_buffers import TierBuffers, materialize_tier, tier_geometry

__all__ = ["KVCacheBuffers", "LayerView", "make_view", "materialize", "plan_layer_views"]


def _check_device(device: object) -> torch.device:
    try:
        target = torch.device(device)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as error:
        raise InvalidFieldError(
            "materialize",
            "device",
            device,
            f"must name a torch device such as 'cpu' or 'cuda:0' ({error})",
        ) from error
    if target.type == "cuda":
        # Checked before anything is allocated (torch's own refusal is a bare assert).
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InvalidFieldError(
                "materialize", "device", device, "names CUDA, which this torch cannot use here"
            )
        if target.index is not None and not 0 <= target.index < count:
            raise InvalidFieldError(
                "materialize",
                "device",
                device,
                f"names CUDA device {target.index}, but only {count} are visible (0..{count - 1})",
            )
    return target


def _check_views(plan: KVCachePlan, views: Sequence[LayerView], where: str) -> None:
    """Make every view on the meta device (no memory), refusing one torch cannot express."""
    meta = [torch.empty(pool.size_bytes, dtype=torch.uint8, device="meta") for pool in plan.pools]
    for view in views:
        try:
            make_view(meta[view.pool], view)
        except RuntimeError as error:
            raise PlanError(
                f"layer {view.layer}{where} cannot be viewed as {view.dtype} at byte offset "
                f"{view.offset} with byte strides {view.strides} in layout {plan.layout}: "
                f"{error}; align the spec's pages (block_stride_alignment) to the dtype size"
            ) from error


class KVCacheBuffers:
    """Backing buffers (one per pool) and per-layer views of a materialised plan; ``tiers``
    maps each offload tier's name (``"host"``, ``"disk"``) to its buffers and views."""

    def __init__(
        self,
        plan: KVCachePlan,
        buffers: list[torch.Tensor],
        layer_views: list[LayerView],
        tiers: Mapping[str, TierBuffers] | None = None,
    ) -> None:
        self.plan = plan
        self.buffers = buffers
        self.tiers: dict[str, TierBuffers] = dict(tiers or {})
        self.layer_views = {view.layer: view for view in layer_views}
        self.views: dict[str, torch.Tensor] = {
            view.layer: make_view(buffers[view.pool], view) for view in layer_views
        }

    def layout_descriptor(self) -> dict[str, Any]:
        """JSON: per layer its tensor index, byte offset, strides, shape and dtype."""
        layers = {}
        for name, view in self.layer_views.items():
            tensor = self.views[name]
            layers[name] = {
                "tensor": view.tensor,
                "pool": view.pool,
                "group": view.group,
                "byte_offset": view.offset,
                "byte_strides": list(view.strides),
                "byte_shape": list(view.shape),
                "shape": list(tensor.shape),
                "strides": list(tensor.stride()),
                "dtype": dtype_name(tensor.dtype),
                "kernel_block_size": view.kernel_block_size,
                "raw": view.raw,
                "aliases": list(self.plan.aliased_layers(name)),
                "kv_source": self.plan.kv_source_of(name),
            }
        return {
            "layout": self.plan.layout,
            "pools": [
                {
                    "id": pool.id,
                    "bytes": pool.size_bytes,
                    "num_blocks": pool.num_blocks,
                    "block_bytes": pool.block_bytes,
                    "host_resident": pool.host_resident,
                    "device": str(self.buffers[pool.id].device),
                }
                for pool in self.plan.pools
            ],
            "layers": layers,
        }


def materialize(
    plan: KVCachePlan,
    device: str | torch.device = "cpu",
    *,
    kernel_block_sizes: Mapping[int, int] | None = None,
    offload_tiers: bool = True,
) -> KVCacheBuffers:
    """Allocate one ``uint8`` buffer per pool on ``device`` (host-resident pools on the CPU)
    and view every layer as the plan says. ``kernel_block_sizes`` maps group ids to a kernel
    block size dividing the group's block size. Buffers are zeroed when the plan needs it.

    With ``offload_tiers`` (the default) the plan's tiers are allocated too
    (``buffers.tiers``): host buffers, pinned when CUDA is available, and for the disk tier
    one new file per pool in its directory (refused, before anything is allocated, when
    the directory is not writable or a file is already there); see
    :mod:`kvspec_core.planner.tier_buffers`."""
    if not isinstance(plan, KVCachePlan):
        raise InvalidFieldTypeError(
            "materialize",
            "plan",
            type(plan).__name__,
            "expected a KVCachePlan (plan_from_dict reads a dict)",
        )
    if offload_tiers.__class__ is not bool:
        raise InvalidFieldTypeError(
            "materialize",
            "offload_tiers",
            offload_tiers,
            "expected True (allocate the plan's tiers, the default) or False",
        )
    target = _check_device(device)
    layer_views = plan_layer_views(plan, kernel_block_sizes)
    _check_views(plan, layer_views, "")
    tier_layouts = []
    for tier in plan.tiers if offload_tiers else ():
        # A tier's views sit at other offsets than the device's in layer-outer layouts (its
        # block count differs), so each is checked too before anything is allocated.
        geometry = tier_geometry(plan, tier)
        tier_views = plan_layer_views(geometry, kernel_block_sizes)
        _check_views(geometry, tier_views, f" ({tier.name})")
        tier_layouts.append((tier, geometry, tier_views))
    make = torch.zeros if plan.needs_zeroing else torch.empty
    buffers = [
        make(
            pool.size_bytes,
            dtype=torch.uint8,
            device=torch.device("cpu") if pool.host_resident else target,
        )
        for pool in plan.pools
    ]
    # Tiers after the device buffers (whose allocation may fail): the disk tier's files are
    # removed again if anything after them fails.
    tiers: dict[str, TierBuffers] = {}
    try:
        for tier, geometry, tier_views in tier_layouts:
            tiers[tier.name] = materialize_tier(plan, tier, geometry, tier_views)
    except BaseException:
        for made in tiers.values():
            made.remove_files()
        raise
    return KVCacheBuffers(plan, buffers, layer_views, tiers)
