"""Sizing the HiSparse host pool: how many host blocks a host byte budget buys.

Every host block holds one page of each host-resident group side by side, so the block
stride is the sum of those groups' pages, rounded up to the pool's alignment, and the pool
holds ``floor(budget / stride)`` blocks. Pure functions: the allocator calls them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import attrs

from kvspec_core.arithmetic import cdiv, round_up
from kvspec_core.context import SizingContext
from kvspec_core.errors import CapacityError, InvalidFieldError, InvalidFieldTypeError, PlanError
from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import MAX_FIELD_VALUE

#: Blocks the pool needs beyond one max-length request: the pool's null block and a
#: copy-on-write tail (the reference engine's HiSparse host-pool check).
HOST_POOL_EXTRA_BLOCKS = 2
#: Largest host budget accepted (far above any machine; keeps absurd inputs out).
MAX_HOST_BUDGET_BYTES = 1 << 64

_OWNER = "size_host_pool"


def _require_int(field: str, value: object, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldTypeError(_OWNER, field, value, "expected an int")
    if not minimum <= value <= maximum:
        raise InvalidFieldError(_OWNER, field, value, f"must be an int in [{minimum}, {maximum}]")
    return value


@attrs.frozen(kw_only=True)
class HostPoolSizing:
    """The host pool a budget buys.

    Attributes:
        num_blocks: host blocks in the pool (the seed's ``hisparse_host_num_blocks``).
        block_stride_bytes: bytes between consecutive host blocks
            (``hisparse_host_block_stride``).
        page_bytes: bytes of real pages in one block (sum of the host groups' pages).
        budget_bytes: the host budget the pool was sized from.
    """

    num_blocks: int
    block_stride_bytes: int
    page_bytes: int
    budget_bytes: int

    @property
    def pool_bytes(self) -> int:
        """Bytes the pool allocates: ``num_blocks * block_stride_bytes``."""
        return self.num_blocks * self.block_stride_bytes

    @property
    def padding_bytes(self) -> int:
        """Bytes of alignment padding across the pool."""
        return self.num_blocks * (self.block_stride_bytes - self.page_bytes)

    @property
    def unused_bytes(self) -> int:
        """Budget left over after the last whole block."""
        return self.budget_bytes - self.pool_bytes


def size_host_pool(
    host_budget_bytes: int,
    page_sizes: Sequence[int],
    *,
    alignment: int = 1,
    min_blocks: int = 1,
) -> HostPoolSizing:
    """Size a host pool whose blocks hold one page of each host-resident group.

    ``block_stride = round_up(sum(page_sizes), alignment)``;
    ``num_blocks = host_budget_bytes // block_stride``. A budget that buys fewer than
    ``min_blocks`` blocks is refused with :class:`CapacityError` naming the bytes needed and
    the bytes available.
    """
    budget = _require_int("host_budget_bytes", host_budget_bytes, 0, MAX_HOST_BUDGET_BYTES)
    is_sequence = isinstance(page_sizes, Sequence) and not isinstance(page_sizes, (str, bytes))
    if not is_sequence or not page_sizes:
        raise InvalidFieldError(
            _OWNER,
            "page_sizes",
            page_sizes,
            "must be a non-empty sequence of the host-resident groups' page sizes in bytes",
        )
    pages = [_require_int("page_sizes", page, 1, MAX_FIELD_VALUE) for page in page_sizes]
    alignment = _require_int("alignment", alignment, 1, MAX_FIELD_VALUE)
    min_blocks = _require_int("min_blocks", min_blocks, 1, MAX_FIELD_VALUE)
    page_bytes = sum(pages)
    stride = round_up(page_bytes, alignment)
    num_blocks = budget // stride
    if num_blocks < min_blocks:
        needed = min_blocks * stride
        raise CapacityError(
            f"host budget of {budget} bytes is below the {needed} bytes the HiSparse host pool "
            f"needs: {min_blocks} block(s) of {stride} bytes (pages {page_bytes} bytes, aligned "
            f"to {alignment}); it holds {num_blocks}. Raise the host budget to at least "
            f"{needed} bytes"
        )
    return HostPoolSizing(
        num_blocks=num_blocks,
        block_stride_bytes=stride,
        page_bytes=page_bytes,
        budget_bytes=budget,
    )


def min_host_blocks(ctx: SizingContext, block_sizes: Iterable[int]) -> int:
    """Host blocks one request of ``ctx.max_model_len`` tokens needs, plus the pool's null
    block and a copy-on-write tail: every computed page of a request lives on the host."""
    sizes = list(block_sizes)
    if not sizes:
        raise PlanError("min_host_blocks needs the host-resident groups' block sizes")
    return max(cdiv(ctx.max_model_len, size) for size in sizes) + HOST_POOL_EXTRA_BLOCKS


def size_host_pool_for_specs(
    host_budget_bytes: int,
    group_specs: Iterable[KVSpec],
    *,
    alignment: int = 1,
    ctx: SizingContext | None = None,
) -> HostPoolSizing:
    """Size the host pool of a plan's groups: only ``host_resident`` group specs take part.

    The alignment is the least common multiple of ``alignment`` and the host groups'
    ``block_stride_alignment``. With ``ctx``, the pool must also hold one request of
    ``ctx.max_model_len`` tokens (see :func:`min_host_blocks`).
    """
    host_specs = [spec for spec in group_specs if spec.host_resident]
    if not host_specs:
        raise PlanError(
            "no host-resident group to size a host pool for; mark the HiSparse source group "
            "with HiSparseGroupSpec(role='hisparse_source')"
        )
    stride_alignment = _require_int("alignment", alignment, 1, MAX_FIELD_VALUE)
    for spec in host_specs:
        if spec.block_stride_alignment is not None:
            stride_alignment = math.lcm(stride_alignment, spec.block_stride_alignment)
    min_blocks = min_host_blocks(ctx, [s.block_size for s in host_specs]) if ctx else 1
    return size_host_pool(
        host_budget_bytes,
        [spec.page_size_bytes for spec in host_specs],
        alignment=stride_alignment,
        min_blocks=min_blocks,
    )
