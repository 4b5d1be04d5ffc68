"""The parts of a KV-cache plan: its groups, pools and tensors, as plain frozen data.

:class:`~kvspec_core.planner.plan.KVCachePlan` holds them; they live apart from it so that
:mod:`kvspec_core.planner.plan_writing` can write them without importing the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from kvspec_core.errors import PlanError
from kvspec_core.planner.budget import pool_concurrency
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.uniform import UniformTypeSpecs, iter_layer_specs


def tuple_of_str(value: Any) -> tuple[str, ...]:
    return tuple(str(item) for item in value)


def _tuple_of_int(value: Any) -> tuple[int, ...]:
    return tuple(int(item) for item in value)


def specs_per_layer(spec: KVSpec, num_layers: int) -> tuple[KVSpec, ...]:
    """One spec per layer of a group whose spec is ``spec``: a uniform-type wrapper's
    members, else ``spec`` for each of its ``num_layers`` layers."""
    if isinstance(spec, UniformTypeSpecs):
        return iter_layer_specs(spec)
    return (spec,) * num_layers


def real_page_bytes(spec: KVSpec) -> int:
    """Bytes of real content in one page; specs without layer views are opaque pages."""
    if not spec.has_layer_views:
        return spec.page_size_bytes
    return spec.unpadded_page_size_bytes


def _spec_counts(specs: Sequence[KVSpec]) -> list[tuple[KVSpec, int]]:
    """Each distinct spec object of ``specs`` with how many layers hold it: a merged group
    repeats one spec for each of its layers, and page sizes are too costly to compute for
    each of 100,000 layers."""
    counts: dict[int, list[Any]] = {}
    for spec in specs:
        entry = counts.get(id(spec))
        if entry is None:
            counts[id(spec)] = [spec, 1]
        else:
            entry[1] += 1
    return [(spec, count) for spec, count in counts.values()]


@attrs.frozen(kw_only=True)
class PlannedGroup:
    """Layers sharing one block table.

    Attributes:
        id: index in :attr:`KVCachePlan.groups`.
        kind: registry kind name (a uniform-type wrapper reports its members' kind).
        layers: layer names, in model order; layer ``j`` uses slot ``j`` of the pool.
        spec: the merged spec (or :class:`UniformTypeSpecs` wrapper) of the group.
        pool: index of the pool whose blocks the group takes.
        blocks_per_request: admission cap, ``spec.max_blocks_per_request(ctx)``.
    """

    id: int
    kind: str
    layers: tuple[str, ...] = attrs.field(converter=tuple_of_str)
    spec: KVSpec
    pool: int
    blocks_per_request: int

    def __attrs_post_init__(self) -> None:
        # A uniform-type spec names its members' layers: a group whose layers disagree
        # would size its pages from one list and lay out its views from the other.
        if isinstance(self.spec, UniformTypeSpecs):
            members = tuple(name for name, _ in self.spec.layer_specs)
            if members != self.layers:
                raise PlanError(
                    f"group {self.id}: field 'layers' {list(self.layers)} does not match its "
                    f"spec's member layers {list(members)} (spec.layer_specs); a group's "
                    "layers are its uniform-type spec's members, in order: build groups "
                    "with plan_kv_cache rather than by hand"
                )

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def layer_specs(self) -> tuple[KVSpec, ...]:
        """One spec per layer, aligned with :attr:`layers`."""
        return specs_per_layer(self.spec, len(self.layers))

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block across the group's layers (padding included)."""
        return sum(spec.page_size_bytes * count for spec, count in _spec_counts(self.layer_specs))

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of real content in one block across the group's layers."""
        return sum(real_page_bytes(spec) * count for spec, count in _spec_counts(self.layer_specs))

    # Placement facts come from the layers (a uniform-type group's members agree on them).
    @property
    def host_resident(self) -> bool:
        return self.layer_specs[0].host_resident

    @property
    def role(self) -> str:
        return self.layer_specs[0].group_role

    @property
    def transferable(self) -> bool:
        return self.layer_specs[0].transferable

    @property
    def prefix_cacheable(self) -> bool:
        return self.spec.prefix_cacheable


@attrs.frozen(kw_only=True)
class Pool:
    """Blocks of one page-size class; block 0 is the reserved null block.

    Attributes:
        num_blocks: blocks in the pool, the null block included.
        block_bytes: physical bytes of one block (every slot, alignment included).
        groups: ids of the groups taking blocks from this pool; their tensors alias.
        blocks_per_request: demand of one max-length request, summed over the groups.
        slot_bytes: per-block bytes of each slot (layer position).
        alignment: byte alignment between blocks.
        fixed_blocks_per_request: of ``blocks_per_request``, the blocks a request holds
            whatever its length (its groups' ``fixed_blocks_per_request``: states, the
            encoder's K/V); a fraction of a request needs them whole.
    """

    id: int
    num_blocks: int
    block_bytes: int
    groups: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    host_resident: bool
    blocks_per_request: int
    slot_bytes: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    alignment: int = 1
    fixed_blocks_per_request: int = 0

    #: Id of the block every pool reserves as the null block.
    null_block: int = 0

    @property
    def size_bytes(self) -> int:
        """Bytes of the pool's backing buffer."""
        return self.num_blocks * self.block_bytes

    @property
    def max_concurrency(self) -> float:
        """Max-length requests the pool's usable blocks admit at once (the last one perhaps
        shorter, its fixed blocks whole: :func:`~kvspec_core.planner.budget.pool_concurrency`)."""
        return float(
            pool_concurrency(
                self.num_blocks, self.blocks_per_request, self.fixed_blocks_per_request
            )
        )


@attrs.frozen(kw_only=True)
class KVCacheTensor:
    """Placement of same-shaped layers of one group in their pool's backing buffer.

    Layer ``layers[l]``'s page of block ``b`` starts ``offset + l * layer_stride +
    b * block_stride`` bytes into the pool buffer of ``size`` bytes. ``strides`` and
    ``shape`` are the full byte-level ``[L, B, H, N, C]`` view (``C`` in bytes). Tensors of
    one pool whose ranges overlap alias: groups overlay each other, block by block.
    """

    size: int
    layers: tuple[str, ...] = attrs.field(converter=tuple_of_str)
    layer_stride: int
    block_stride: int
    offset: int = 0
    host_resident: bool = False
    pool: int
    group: int
    shape: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    strides: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    raw: bool = False


#: Names of the offload tiers, in the order a plan holds them (fastest first).
TIER_NAMES = ("host", "disk")


@attrs.frozen(kw_only=True)
class PlannedTier:
    """A slower tier the KV cache offloads blocks to: host DRAM or files on a local disk.

    A tier block of pool ``p`` has exactly ``p``'s block bytes and page layout, so a block
    moves between the device and a tier as whole pages. Each tier's budget is split between
    the device pools as the device budget is (demand-weighted), so every pool's tier holds
    tokens in the same proportion as its device pool. Like a device pool, a tier's pool
    reserves block 0 as its null block.

    Attributes:
        name: ``"host"`` (pinned host memory) or ``"disk"`` (one file per pool under
            ``path``).
        budget_bytes: bytes the tier may use.
        path: the directory holding the disk tier's files (absolute); ``None`` for host.
        blocks_per_pool: blocks of each plan pool in this tier, null block included, in
            pool order; 0 for host-resident pools, which are not offloaded.
        bytes_allocated: bytes the tier's blocks take (at most ``budget_bytes``).
    """

    name: str
    budget_bytes: int
    path: str | None = None
    blocks_per_pool: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    bytes_allocated: int
