"""Where each layer's pages sit inside a pool's backing buffer.

A pool holds ``num_blocks`` blocks; every block has one *slot* per layer position of the
groups sharing the pool (layer ``j`` of every group uses slot ``j``: a block id belongs to one
group at a time, so groups overlay the same bytes). Slots of equal geometry form *segments*,
each laid out as one dense ``[L, B, H, N, C]`` array in the pool's layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from kvspec_core.errors import PlanError
from kvspec_core.planner.layouts import DIM_B, DIM_H, DIM_L, KVCacheLayout, aligned, layout_strides
from kvspec_core.specs.base import KVSpec


@attrs.frozen
class CellShape:
    """One layer's page as the planner addresses it: ``heads x states x content`` bytes,
    occupying ``page`` bytes (``padded_page`` when padding follows the content)."""

    heads: int
    states: int
    content: int
    page: int
    raw: bool

    @property
    def dense_page(self) -> int:
        return self.heads * self.states * self.content

    @property
    def padded_page(self) -> int | None:
        return self.page if self.page != self.dense_page else None


def cell_shape(spec: KVSpec, layer: str) -> CellShape:
    """The page geometry of ``spec``; specs without layer views are one opaque page."""
    page = spec.page_size_bytes
    if not spec.has_layer_views:
        return CellShape(heads=1, states=1, content=page, page=page, raw=True)
    cell = CellShape(
        heads=spec.num_heads,
        states=spec.num_states,
        content=spec.state_content_size_bytes,
        page=page,
        raw=False,
    )
    if cell.page < cell.dense_page:
        raise PlanError(
            f"layer {layer}: {type(spec).__name__}.page_size_bytes={page} is smaller than its "
            f"heads x states x content = {cell.heads} x {cell.states} x {cell.content} = "
            f"{cell.dense_page} bytes; fix the spec's page geometry"
        )
    return cell


@attrs.frozen
class SlotShape:
    """What the pool needs to know of a slot: ``[H, N, C]`` at pool level, padded page."""

    heads: int
    states: int
    content: int
    padded_page: int | None


def slot_shape(cell: CellShape, layout: KVCacheLayout) -> SlotShape:
    """Slot geometry under ``layout``: a plain page where pages are contiguous, else the
    head axis stays visible because it lies outside the page (LHBNC, BHLNC)."""
    if layout.page_contiguous:
        return SlotShape(heads=1, states=1, content=cell.page, padded_page=None)
    return SlotShape(
        heads=cell.heads,
        states=1,
        content=cell.states * cell.content,
        padded_page=cell.padded_page,
    )


@attrs.frozen
class Segment:
    """``count`` consecutive slots of one shape."""

    count: int
    shape: SlotShape


@attrs.frozen
class SegmentPlacement:
    """A segment's byte offset in the buffer and its ``[L, B, H, N, C]`` byte strides."""

    offset: int
    strides: tuple[int, ...]


def segments_of(slot_runs: Sequence[Sequence[tuple[SlotShape, int]]]) -> list[Segment]:
    """Segments holding every group's slots, given as ``(shape, count)`` runs of equal
    shapes (groups of one pool agree slot-wise; a pool of single-shape groups has as many
    slots as its largest group)."""
    longest = max(slot_runs, key=lambda runs: sum(count for _, count in runs))
    return [Segment(count, shape) for shape, count in longest]


def _shape5(segment: Segment, num_blocks: int) -> tuple[int, int, int, int, int]:
    shape = segment.shape
    return (segment.count, num_blocks, shape.heads, shape.states, shape.content)


def place_segments(
    segments: Sequence[Segment], layout: KVCacheLayout, alignment: int, num_blocks: int
) -> tuple[int, list[SegmentPlacement]]:
    """Per-block bytes of the pool and each segment's placement for ``num_blocks`` blocks.

    Block-outer layouts pack all slots of a block together, rounding the block to
    ``alignment``; layer-outer layouts give each slot a region whose block stride is
    rounded to ``alignment``.
    """
    if layout.layer_outer:
        placements = []
        offset = 0
        block_bytes = 0
        for segment in segments:
            natural = layout_strides(
                _shape5(segment, 1), layout, padded_page=segment.shape.padded_page
            )
            block_stride = aligned(natural[DIM_B], alignment)
            per_block = layout_strides(
                _shape5(segment, 1),
                layout,
                padded_page=segment.shape.padded_page,
                fixed=(None, block_stride, None, None, None),
            )
            strides = layout_strides(
                _shape5(segment, num_blocks),
                layout,
                padded_page=segment.shape.padded_page,
                fixed=(None, block_stride, None, None, None),
            )
            placements.append(SegmentPlacement(offset, strides))
            offset += strides[DIM_L] * segment.count
            block_bytes += per_block[DIM_L] * segment.count
        return block_bytes, placements
    extents = []
    for segment in segments:
        natural = layout_strides(_shape5(segment, 1), layout, padded_page=segment.shape.padded_page)
        extents.append(natural[DIM_B])
    block_bytes = aligned(sum(extents), alignment)
    placements = []
    offset = 0
    for segment, extent in zip(segments, extents, strict=True):
        strides = layout_strides(
            _shape5(segment, num_blocks),
            layout,
            padded_page=segment.shape.padded_page,
            fixed=(None, block_bytes, None, None, None),
        )
        placements.append(SegmentPlacement(offset, strides))
        offset += extent
    return block_bytes, placements


def tensor_strides(
    cell: CellShape,
    count: int,
    num_blocks: int,
    layout: KVCacheLayout,
    placement: SegmentPlacement,
) -> tuple[int, ...]:
    """Byte strides of ``count`` layers of geometry ``cell`` inside a placed segment: the
    pool fixes the axes that address pages, the cell its own page tail."""
    grid = set(layout.grid_dims)
    fixed = tuple(
        placement.strides[dim] if dim in grid and dim in (DIM_L, DIM_B, DIM_H) else None
        for dim in range(5)
    )
    shape = (count, num_blocks, cell.heads, cell.states, cell.content)
    return layout_strides(shape, layout, padded_page=cell.padded_page, fixed=fixed)


def lcm_alignment(alignments: Sequence[int | None]) -> int:
    """Least common multiple of the set alignments (1 when none is set)."""
    result = 1
    for value in alignments:
        if value:
            result = math.lcm(result, value)
    return result


def view_extent(shape: Sequence[int], strides: Sequence[int], offset: int) -> int:
    """One past the last byte an ``as_strided`` byte view touches."""
    if any(size == 0 for size in shape):
        return offset
    reach = sum((size - 1) * stride for size, stride in zip(shape, strides, strict=True))
    return offset + reach + 1
