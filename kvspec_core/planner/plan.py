"""The plan: groups, pools and tensors as plain, engine-neutral, serialisable data.

The parts (:class:`PlannedGroup`, :class:`Pool`, :class:`KVCacheTensor`) are defined in
:mod:`kvspec_core.planner.plan_parts` and importable from here too; the JSON format
:meth:`KVCachePlan.to_dict` writes is :mod:`kvspec_core.planner.plan_writing`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import PlanError
from kvspec_core.planner.plan_parts import (
    KVCacheTensor,
    PlannedGroup,
    PlannedTier,
    Pool,
    tuple_of_str,
)
from kvspec_core.planner.plan_writing import (
    PLAN_FORMAT_VERSION,
    group_to_dict,
    input_checksums,
    pool_to_dict,
    tensor_to_dict,
    tier_to_dict,
)
from kvspec_core.specs.attention import AttentionSpec

__all__ = [
    "PLAN_FORMAT_VERSION",
    "KVCachePlan",
    "KVCacheTensor",
    "PlannedGroup",
    "PlannedTier",
    "Pool",
]


# One converter per element type (rather than ``converter=tuple``) so type checkers see
# ``KVCachePlan``'s constructor take iterables of the right element type.
def _tuple_of_groups(items: Iterable[PlannedGroup]) -> tuple[PlannedGroup, ...]:
    return tuple(items)


def _tuple_of_pools(items: Iterable[Pool]) -> tuple[Pool, ...]:
    return tuple(items)


def _tuple_of_tensors(items: Iterable[KVCacheTensor]) -> tuple[KVCacheTensor, ...]:
    return tuple(items)


def _tuple_of_tiers(items: Iterable[PlannedTier]) -> tuple[PlannedTier, ...]:
    return tuple(items)


def _pairs_of_layers(items: Iterable[Iterable[str]]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in items:
        reader, source = item
        pairs.append((str(reader), str(source)))
    return tuple(pairs)


@attrs.frozen(kw_only=True)
class KVCachePlan:
    """Everything an engine needs to allocate, view and admit; pure data.

    ``num_blocks`` counts every pool's blocks (null blocks included). ``max_concurrency`` is
    how many requests of ``context.max_model_len`` the runtime admits at once (the minimum
    over pools of usable blocks over demand; 0.0 when no layer needs KV memory, as nothing
    is admitted against a cache). ``bytes_padding`` is what the budget holds
    beyond real content: page padding, block alignment, and budget left idle. ``tiers``
    are the offload tiers (host, then disk; empty when none was asked for). ``kv_sharing``
    lists ``(reader, source)`` for every layer that reads another layer's cache (cross-layer
    KV sharing): the reader is a memoryless layer (no group, no blocks) whose view is its
    source's.
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
    memoryless_layers: tuple[str, ...] = attrs.field(default=(), converter=tuple_of_str)
    tiers: tuple[PlannedTier, ...] = attrs.field(default=(), converter=_tuple_of_tiers)
    kv_sharing: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_pairs_of_layers)

    # ----------------------------------------------------------------- totals
    @property
    def num_blocks(self) -> int:
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def device_pools(self) -> tuple[Pool, ...]:
        return tuple(pool for pool in self.pools if not pool.host_resident)

    def tier(self, name: str) -> PlannedTier | None:
        """The offload tier called ``name`` (``"host"``, ``"disk"``), ``None`` if not planned."""
        return next((tier for tier in self.tiers if tier.name == name), None)

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
        """Layers whose pages overlay ``layer``'s: those of other groups in the same pool and
        slot, each followed by the layers reading its cache; then the layers reading the
        same cache as ``layer`` (cross-layer KV sharing: a reader's source, and every other
        reader of it)."""
        source = self.kv_source_of(layer)
        owner = layer if source is None else source
        pool_id, slot = self.slot_of(owner)
        own = self.group_of(owner).id
        twins: list[str] = []
        for group in self.groups:
            if group.pool == pool_id and group.id != own and slot < len(group.layers):
                # A twin's readers view the twin's bytes, so they overlay layer's too.
                twins += (group.layers[slot], *self.kv_readers_of(group.layers[slot]))
        readers = tuple(reader for reader in self.kv_readers_of(owner) if reader != layer)
        return (*twins, *((source,) if source is not None else ()), *readers)

    def kv_source_of(self, layer: str) -> str | None:
        """The layer whose cache ``layer`` reads (cross-layer KV sharing), else ``None``."""
        return next((source for reader, source in self.kv_sharing if reader == layer), None)

    def kv_readers_of(self, layer: str) -> tuple[str, ...]:
        """The layers that read ``layer``'s cache, in model order."""
        return tuple(reader for reader, source in self.kv_sharing if source == layer)

    def cache_group_of(self, layer: str) -> PlannedGroup:
        """The group whose blocks ``layer`` reads: its own, or its source's for a layer that
        reads another's cache (its block table and slot mapping are that group's)."""
        source = self.kv_source_of(layer)
        return self.group_of(layer if source is None else source)

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

    def select_transfer_block_ids(
        self, block_ids: Sequence[Sequence[int]]
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
            "groups": [group_to_dict(group) for group in self.groups],
            "pools": [pool_to_dict(pool) for pool in self.pools],
            "tensors": [tensor_to_dict(tensor) for tensor in self.tensors],
            "tiers": [tier_to_dict(tier) for tier in self.tiers],
            "kv_sharing": [
                {"layer": reader, "source": source} for reader, source in self.kv_sharing
            ],
        }
        data["input_checksums"] = input_checksums(data)
        return data
