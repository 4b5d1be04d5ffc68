"""Each layer's view of its pool buffer: byte geometry (kernel blocks split as asked),
checked against the buffer before any memory is allocated, and the strided view itself.
Shared by the device pools (:mod:`~kvspec_core.planner.views`) and the offload tiers
(:mod:`~kvspec_core.planner.tier_buffers`)."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping

import attrs
import torch

from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.planner.geometry import cell_shape, view_extent
from kvspec_core.planner.layouts import DIM_B, DIM_H, DIM_L, aligned, get_layout, layout_strides
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.plan_parts import KVCacheTensor
from kvspec_core.specs.base import KVSpec


@attrs.frozen
class LayerView:
    """How one layer is viewed: byte-level 4D ``[B, H, N, C]`` geometry plus dtype."""

    layer: str
    tensor: int
    pool: int
    group: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype | None
    kernel_block_size: int
    raw: bool


def _kernel_geometry(
    tensor: KVCacheTensor,
    spec: KVSpec,
    layout_name: str,
    pool_alignment: int,
    kernel_block_size: int | None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``[L, B, H, N, C]`` byte shape and strides, manager blocks split into kernel blocks."""
    if kernel_block_size is None:
        return tensor.shape, tensor.strides
    if (
        isinstance(kernel_block_size, bool)
        or not isinstance(kernel_block_size, int)
        or kernel_block_size < 1
        or spec.block_size % kernel_block_size
    ):
        raise PlanError(
            f"kernel block size {kernel_block_size!r} must be a positive divisor of the KV "
            f"cache block size {spec.block_size} (layers {', '.join(tensor.layers[:3])})"
        )
    if kernel_block_size == spec.block_size or tensor.raw:
        return tensor.shape, tensor.strides
    layout = get_layout(layout_name)
    ratio = spec.block_size // kernel_block_size
    cell = cell_shape(spec, tensor.layers[0])
    if cell.padded_page is not None:
        raise PlanError(
            f"layers {', '.join(tensor.layers[:3])} have padded pages ({cell.page} bytes for "
            f"{cell.dense_page} of content); padded pages cannot be split into kernel blocks "
            f"of {kernel_block_size} tokens: use block size {kernel_block_size} or no padding"
        )
    kernel_states = spec.num_kernel_states(kernel_block_size)
    if kernel_states * ratio != cell.states:
        raise PlanError(
            f"layers {', '.join(tensor.layers[:3])} keep {cell.states} state(s) per block of "
            f"{spec.block_size} tokens, which do not divide into {ratio} kernel blocks of "
            f"{kernel_block_size} tokens ({kernel_states} state(s) each); use a kernel block "
            "size that holds whole states, or none for this group"
        )
    block_stride = tensor.block_stride
    if (
        block_stride != cell.dense_page
        and pool_alignment > 1
        and block_stride == aligned(cell.dense_page, pool_alignment)
    ):
        raise PlanError(
            f"layers {', '.join(tensor.layers[:3])}: the pool's block_stride_alignment="
            f"{pool_alignment} rounds the block stride to {block_stride} bytes, past the "
            f"{cell.dense_page}-byte page, so a manager block of {spec.block_size} tokens "
            f"cannot be split into {ratio} kernel blocks of {kernel_block_size} tokens; "
            f"use block size {kernel_block_size} or no kernel split for this group"
        )
    if block_stride != cell.dense_page:
        raise PlanError(
            f"the KV cache layout ({layout_name}) does not store blocks as dense, unpadded "
            f"pages (block stride {block_stride} != page {cell.dense_page}, layer stride "
            f"{tensor.layer_stride}), so a manager block of {spec.block_size} tokens cannot be "
            f"split into {ratio} kernel blocks of {kernel_block_size} tokens. Reduce the block "
            f"size to {kernel_block_size} or use a layer-compact layout (e.g. LBNHC)."
        )
    if block_stride % ratio:
        raise PlanError(
            f"block stride {block_stride} of layers {', '.join(tensor.layers[:3])} does not "
            f"divide into {ratio} equal kernel blocks of {kernel_block_size} tokens"
        )
    shape = (
        tensor.shape[DIM_L],
        tensor.shape[DIM_B] * ratio,
        cell.heads,
        kernel_states,
        cell.content,
    )
    grid = layout.grid_dims
    fixed = (
        tensor.layer_stride,
        block_stride // ratio,
        tensor.strides[DIM_H] if DIM_H in grid else None,
        None,
        None,
    )
    return shape, layout_strides(shape, layout, fixed=fixed)


def _check_kernel_block_sizes(
    plan: KVCachePlan, kernel_block_sizes: Mapping[int, int] | None
) -> dict[int, int]:
    if kernel_block_sizes is None:
        return {}
    if not isinstance(kernel_block_sizes, Mapping):
        raise InvalidFieldTypeError(
            "materialize",
            "kernel_block_sizes",
            kernel_block_sizes,
            "expected a mapping of group id -> kernel block size",
        )
    group_ids = {group.id for group in plan.groups}
    unknown = [
        key
        for key in kernel_block_sizes
        if isinstance(key, bool) or not isinstance(key, int) or key not in group_ids
    ]
    if unknown:
        raise InvalidFieldError(
            "materialize",
            "kernel_block_sizes",
            unknown,
            f"keys must be group ids of the plan (0..{len(plan.groups) - 1})",
        )
    # A None value used to mean "no split" silently; leave the group out for that. Integers
    # of other types (numpy's, a 0-d tensor) are read through __index__.
    sizes: dict[int, int] = {}
    for key, value in kernel_block_sizes.items():
        size: int | None = None
        if value.__class__ is not bool:
            with contextlib.suppress(TypeError):
                size = operator.index(value)
        if size is None:
            raise InvalidFieldTypeError(
                "materialize",
                f"kernel_block_sizes[{key}]",
                value,
                "expected an int kernel block size dividing the group's block size (leave "
                "the group out for no split)",
            )
        sizes[key] = size
    return sizes


def plan_layer_views(
    plan: KVCachePlan, kernel_block_sizes: Mapping[int, int] | None = None
) -> list[LayerView]:
    """Every layer's view geometry, validated against its pool buffer (no allocation); a
    layer reading another's cache (``plan.kv_sharing``) gets its source's geometry."""
    kernel_block_sizes = _check_kernel_block_sizes(plan, kernel_block_sizes)
    result = []
    for index, tensor in enumerate(plan.tensors):
        group = plan.groups[tensor.group]
        spec = group.layer_specs[group.layers.index(tensor.layers[0])]
        kernel = kernel_block_sizes.get(group.id)
        shape, strides = _kernel_geometry(
            tensor, spec, plan.layout, plan.pools[tensor.pool].alignment, kernel
        )
        extent = view_extent(shape, strides, tensor.offset)
        if extent > tensor.size:
            raise PlanError(
                f"layers {', '.join(tensor.layers[:3])}: view reaches byte {extent} of a "
                f"{tensor.size}-byte pool buffer (offset {tensor.offset}, strides {strides})"
            )
        dtype = None if tensor.raw else spec.view_dtype
        for position, layer in enumerate(tensor.layers):
            result.append(
                LayerView(
                    layer=layer,
                    tensor=index,
                    pool=tensor.pool,
                    group=tensor.group,
                    offset=tensor.offset + position * strides[DIM_L],
                    shape=tuple(shape[1:]),
                    strides=tuple(strides[1:]),
                    dtype=dtype,
                    kernel_block_size=kernel or spec.block_size,
                    raw=tensor.raw,
                )
            )
    return result + _reader_views(plan, result)


def _reader_views(plan: KVCachePlan, views: list[LayerView]) -> list[LayerView]:
    """The views of layers that read another layer's cache: their source's geometry, so
    each is a view of the very bytes its source's view covers."""
    by_layer = {view.layer: view for view in views}
    return [
        attrs.evolve(by_layer[source], layer=reader)
        for reader, source in plan.kv_sharing
        if source in by_layer
    ]


def make_view(buffer: torch.Tensor, view: LayerView) -> torch.Tensor:
    """``view`` of the pool ``buffer``: strided bytes reinterpreted in the view's dtype."""
    if view.raw:
        return buffer
    layer = torch.as_strided(
        buffer,
        size=view.shape,
        stride=view.strides,
        storage_offset=buffer.storage_offset() + view.offset,
    )
    if view.dtype is not None:
        layer = layer.view(view.dtype)
    return layer
