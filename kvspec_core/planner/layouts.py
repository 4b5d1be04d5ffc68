"""KV-cache layouts: the physical order of the logical ``[L, B, H, N, C]`` axes.

``L`` layers, ``B`` blocks, ``H`` heads (head slots), ``N`` states per block, ``C`` bytes of
one (head, state) cell. A layout names the axes outermost first: ``LBHNC`` gives each layer a
contiguous region of whole pages, ``BLHNC`` packs every layer's page of one block together.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from kvspec_core.arithmetic import round_up
from kvspec_core.errors import PlanError

DIM_L, DIM_B, DIM_H, DIM_N, DIM_C = range(5)
_AXIS_LETTERS = "LBHNC"


@attrs.frozen
class KVCacheLayout:
    """A named physical axis order; ``stride_order`` lists logical axes outermost first."""

    name: str
    stride_order: tuple[int, ...]

    @property
    def layer_outer(self) -> bool:
        """Whether L is outside B: each layer owns a region of all blocks."""
        return self.stride_order.index(DIM_L) < self.stride_order.index(DIM_B)

    @property
    def page_grid_end(self) -> int:
        """Physical axes before this index (L, B and what lies between) address pages."""
        return max(self.stride_order.index(DIM_L), self.stride_order.index(DIM_B)) + 1

    @property
    def grid_dims(self) -> tuple[int, ...]:
        return self.stride_order[: self.page_grid_end]

    @property
    def page_contiguous(self) -> bool:
        """Whether one layer's page of one block is a contiguous byte range."""
        return DIM_H not in self.grid_dims


def _layout(name: str) -> KVCacheLayout:
    return KVCacheLayout(name, tuple(_AXIS_LETTERS.index(letter) for letter in name))


#: The six supported layouts, as the seed's engine names them.
LAYOUTS: dict[str, KVCacheLayout] = {
    name: _layout(name) for name in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
}


def get_layout(name: str) -> KVCacheLayout:
    """The layout called ``name`` (case-insensitive); unknown names are refused listing all."""
    layout = LAYOUTS.get(name.upper()) if isinstance(name, str) else None
    if layout is None:
        raise PlanError(f"unknown KV-cache layout {name!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def layout_strides(
    shape: Sequence[int],
    layout: KVCacheLayout,
    *,
    padded_page: int | None = None,
    fixed: Sequence[int | None] = (None,) * 5,
) -> tuple[int, ...]:
    """Byte strides in logical ``[L, B, H, N, C]`` order for a dense array of ``shape``.

    ``fixed`` pins strides of some axes (the pool decides where layers and blocks sit);
    ``padded_page`` widens the innermost page-grid axis to a padded page, which only works
    when every axis outside the page tail is L, B or of size 1 (else the pages would not
    be separable). Raises :class:`PlanError` naming the layout and shape otherwise.
    """
    order = layout.stride_order
    grid_end = layout.page_grid_end
    if padded_page is not None:
        grid_cells = 1
        for dim in order[:grid_end]:
            grid_cells *= shape[dim]
        if grid_cells != shape[DIM_L] * shape[DIM_B]:
            raise PlanError(
                f"layout {layout.name} cannot hold padded pages of {padded_page} bytes for "
                f"shape [L, B, H, N, C]={list(shape)}: the head axis lies outside the page, so "
                "padding would split heads; use a page-contiguous layout (LBHNC, LBNHC, BLHNC "
                "or BLNHC) or a spec without page_size_padded"
            )
    strides = [0] * 5
    current = 1
    for physical, dim in reversed(tuple(enumerate(order))):
        if padded_page is not None and physical == grid_end - 1:
            current = max(current, padded_page)
        strides[dim] = fixed[dim] or current
        current = strides[dim] * shape[dim]
    return tuple(strides)


def aligned(stride: int, alignment: int) -> int:
    """``stride`` rounded up to ``alignment`` bytes."""
    return round_up(stride, alignment) if alignment > 1 else stride
