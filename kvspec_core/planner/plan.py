"""The plan: groups, pools and tensors as plain, engine-neutral, serialisable data."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import PlanError
from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.serialization import spec_to_dict
from kvspec_core.specs.uniform import UniformTypeSpecs, iter_layer_specs

#: Version of :meth:`KVCachePlan.to_dict`'s format (2 added ``input_checksums``).
PLAN_FORMAT_VERSION = 2

#: Inputs of a plan that no other field of it derives from, checksummed in
#: ``input_checksums`` (``num_blocks`` stands for the pools' block counts); each group's
#: ``layers`` and ``spec`` are inputs too (``groups[0].spec``...).
CHECKSUMMED_INPUTS = ("layout", "context", "budget_bytes", "host_budget_bytes",
                      "memoryless_layers", "num_blocks")


def input_checksums(data: Mapping[str, Any]) -> dict[str, str]:
    """A checksum of each input of the plan ``data`` describes (a document written by
    :meth:`KVCachePlan.to_dict`): :data:`CHECKSUMMED_INPUTS` and each group's layers and
    spec. Every other field follows from these and is re-derived when a plan is read back;
    a spec field that changes no derived figure (a window that needs as many blocks) could
    not be told edited otherwise. They guard against hand edits and corruption, not forgery."""
    values = {name: data[name] for name in CHECKSUMMED_INPUTS if name != "num_blocks"}
    values["num_blocks"] = [pool["num_blocks"] for pool in data["pools"]]
    for index, group in enumerate(data["groups"]):
        values[f"groups[{index}].layers"] = group["layers"]
        values[f"groups[{index}].spec"] = group["spec"]
    return {
        name: hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()
                             ).hexdigest()[:16]
        for name, value in values.items()
    }


def _tuple_of_str(value: Any) -> tuple[str, ...]:
    return tuple(str(item) for item in value)


def _tuple_of_int(value: Any) -> tuple[int, ...]:
    return tuple(int(item) for item in value)


# One converter per element type (rather than ``converter=tuple``) so type checkers see
# ``KVCachePlan``'s constructor take iterables of the right element type.
def _tuple_of_groups(items: Iterable[PlannedGroup]) -> tuple[PlannedGroup, ...]:
    return tuple(items)


def _tuple_of_pools(items: Iterable[Pool]) -> tuple[Pool, ...]:
    return tuple(items)


def _tuple_of_tensors(items: Iterable[KVCacheTensor]) -> tuple[KVCacheTensor, ...]:
    return tuple(items)


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
    layers: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    spec: KVSpec
    pool: int
    blocks_per_request: int

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
    """

    id: int
    num_blocks: int
    block_bytes: int
    groups: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    host_resident: bool
    blocks_per_request: int
    slot_bytes: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    alignment: int = 1

    #: Id of the block every pool reserves as the null block.
    null_block: int = 0

    @property
    def size_bytes(self) -> int:
        """Bytes of the pool's backing buffer."""
        return self.num_blocks * self.block_bytes

    @property
    def max_concurrency(self) -> float:
        """Max-length requests the pool's usable blocks admit at once."""
        return (self.num_blocks - 1) / self.blocks_per_request


@attrs.frozen(kw_only=True)
class KVCacheTensor:
    """Placement of same-shaped layers of one group in their pool's backing buffer.

    Layer ``layers[l]``'s page of block ``b`` starts ``offset + l * layer_stride +
    b * block_stride`` bytes into the pool buffer of ``size`` bytes. ``strides`` and
    ``shape`` are the full byte-level ``[L, B, H, N, C]`` view (``C`` in bytes). Tensors of
    one pool whose ranges overlap alias: groups overlay each other, block by block.
    """

    size: int
    layers: tuple[str, ...] = attrs.field(converter=_tuple_of_str)
    layer_stride: int
    block_stride: int
    offset: int = 0
    host_resident: bool = False
    pool: int
    group: int
    shape: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    strides: tuple[int, ...] = attrs.field(converter=_tuple_of_int)
    raw: bool = False


@attrs.frozen(kw_only=True)
class KVCachePlan:
    """Everything an engine needs to allocate, view and admit; pure data.

    ``num_blocks`` counts every pool's blocks (null blocks included). ``max_concurrency`` is
    how many requests of ``context.max_model_len`` the runtime admits at once (the minimum
    over pools of usable blocks over demand; 0.0 when no layer needs KV memory, as nothing
    is admitted against a cache). ``bytes_padding`` is what the budget holds
    beyond real content: page padding, block alignment, and budget left idle.
    """

    groups: tuple[PlannedGroup, ...] = attrs.field(converter=_tuple_of_groups)
    pools: tuple[Pool, ...] = attrs.field(converter=_tuple_of_pools)
    tensors: tuple[KVCacheTensor, ...] = attrs.field(converter=_tuple_of_tensors)
    layout: str
    context: SizingContext
    budget_bytes: int
    host_budget_bytes: int | None = None
    bytes_allocated: int
    host_bytes_allocated: int = 0
    bytes_padding: int
    padding_breakdown: tuple[tuple[str, int], ...] = attrs.field(
        converter=lambda items: tuple((str(k), int(v)) for k, v in items)
    )
    max_concurrency: float
    memoryless_layers: tuple[str, ...] = attrs.field(default=(), converter=_tuple_of_str)

    # ----------------------------------------------------------------- totals
    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def device_pools(self) -> tuple[Pool, ...]:
        return tuple(pool for pool in self.pools if not pool.host_resident)

    # ----------------------------------------------------------------- lookups
    def group_of(self, layer: str) -> PlannedGroup:
        """The group holding ``layer``."""
        for group in self.groups:
            if layer in group.layers:
                return group
        raise KeyError(f"layer {layer!r} is in no group of this plan")

    def slot_of(self, layer: str) -> tuple[int, int]:
        """``(pool, slot)`` of ``layer``: the bytes it shares with other groups' layers."""
        group = self.group_of(layer)
        return group.pool, group.layers.index(layer)

    def aliased_layers(self, layer: str) -> tuple[str, ...]:
        """Layers of other groups whose pages overlay ``layer``'s (same pool and slot)."""
        pool_id, slot = self.slot_of(layer)
        own = self.group_of(layer).id
        return tuple(
            group.layers[slot]
            for group in self.groups
            if group.pool == pool_id and group.id != own and slot < len(group.layers)
        )

    @property
    def aliases(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """``(pool, group ids)`` for every pool shared by several groups (their tensors
        alias slot by slot; a block id is owned by one group at a time)."""
        return tuple((pool.id, pool.groups) for pool in self.pools if len(pool.groups) > 1)

    # ----------------------------------------------------------------- group facts
    @property
    def transfer_group_ids(self) -> tuple[int, ...]:
        return tuple(group.id for group in self.groups if group.transferable)

    @property
    def prefix_cacheable_group_ids(self) -> tuple[int, ...]:
        return tuple(gid for gid in self.transfer_group_ids if self.groups[gid].prefix_cacheable)

    @property
    def transfer_group_index_by_layer(self) -> dict[str, int]:
        """For each layer of a transferable group, that group's index among the transfer
        groups."""
        return {
            layer: index
            for index, gid in enumerate(self.transfer_group_ids)
            for layer in self.groups[gid].layers
        }

    def select_transfer_block_ids(self, block_ids: Sequence[Sequence[int]]
                                  ) -> tuple[Sequence[int], ...]:
        """The per-group block ids of the transferable groups, from one list per group."""
        if len(block_ids) != len(self.groups):
            raise PlanError(
                f"expected block ids for {len(self.groups)} KV cache groups, got {len(block_ids)}"
            )
        return tuple(block_ids[gid] for gid in self.transfer_group_ids)

    def num_blocks_of(self, tensor: KVCacheTensor) -> int:
        """Blocks addressable through ``tensor`` (its pool's, null block included)."""
        return self.pools[tensor.pool].num_blocks

    @property
    def host_group_ids(self) -> tuple[int, ...]:
        return tuple(group.id for group in self.groups if group.host_resident)

    @property
    def has_state_layers(self) -> bool:
        """Whether some layer keeps one recurrent state per block (Mamba-like), whose state
        is read before it is fully written."""
        return any(
            spec.has_layer_views and spec.tokens_per_state <= 0
            for group in self.groups
            for spec in group.layer_specs
        )

    @property
    def has_mixed_precision(self) -> bool:
        """Whether device attention caches use more than one (dtype, quant mode)."""
        precisions = {
            (spec.dtype, spec.kv_quant_mode)
            for group in self.groups
            if not group.host_resident
            for spec in group.layer_specs
            if isinstance(spec, AttentionSpec)
        }
        return len(precisions) > 1

    @property
    def needs_zeroing(self) -> bool:
        """Whether new blocks must be zeroed: state layers read before written, or a block
        reused across groups of different precision could decode stale bytes to NaN."""
        return self.has_state_layers or self.has_mixed_precision

    # ----------------------------------------------------------------- plain data
    def to_dict(self) -> dict[str, Any]:
        """JSON-able description;
        :func:`~kvspec_core.planner.plan_from_dict` rebuilds an equal plan."""
        data: dict[str, Any] = {
            "format_version": PLAN_FORMAT_VERSION,
            "layout": self.layout,
            "context": attrs.asdict(self.context),
            "budget_bytes": self.budget_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "num_blocks": self.num_blocks,
            "bytes_allocated": self.bytes_allocated,
            "host_bytes_allocated": self.host_bytes_allocated,
            "bytes_padding": self.bytes_padding,
            "padding_breakdown": dict(self.padding_breakdown),
            "max_concurrency": self.max_concurrency,
            "memoryless_layers": list(self.memoryless_layers),
            "has_mixed_precision": self.has_mixed_precision,
            "needs_zeroing": self.needs_zeroing,
            "transfer_group_ids": list(self.transfer_group_ids),
            "host_group_ids": list(self.host_group_ids),
            "aliases": [{"pool": pool, "groups": list(groups)} for pool, groups in self.aliases],
            "groups": [
                {
                    "id": group.id,
                    "kind": group.kind,
                    "layers": list(group.layers),
                    "block_size": group.block_size,
                    "page_size_bytes": group.page_size_bytes,
                    "pool": group.pool,
                    "blocks_per_request": group.blocks_per_request,
                    "host_resident": group.host_resident,
                    "role": group.role,
                    "transferable": group.transferable,
                    "prefix_cacheable": group.prefix_cacheable,
                    "spec": spec_to_dict(group.spec),
                }
                for group in self.groups
            ],
            "pools": [
                {
                    "id": pool.id,
                    "num_blocks": pool.num_blocks,
                    "block_bytes": pool.block_bytes,
                    "groups": list(pool.groups),
                    "host_resident": pool.host_resident,
                    "blocks_per_request": pool.blocks_per_request,
                    "slot_bytes": list(pool.slot_bytes),
                    "alignment": pool.alignment,
                    "null_block": pool.null_block,
                    "max_concurrency": pool.max_concurrency,
                }
                for pool in self.pools
            ],
            "tensors": [
                {
                    "size": tensor.size,
                    "layers": list(tensor.layers),
                    "layer_stride": tensor.layer_stride,
                    "block_stride": tensor.block_stride,
                    "offset": tensor.offset,
                    "host_resident": tensor.host_resident,
                    "pool": tensor.pool,
                    "group": tensor.group,
                    "shape": list(tensor.shape),
                    "strides": list(tensor.strides),
                    "raw": tensor.raw,
                }
                for tensor in self.tensors
            ],
        }
        data["input_checksums"] = input_checksums(data)
        return data
