"""Layers -> KV-cache groups, by the registry's merge and uniformity rules.

* Every layer mergeable into one spec: one group of all layers.
* Otherwise, if the registry deems all layers of one type (same blocks per token, different
  shapes): one :class:`UniformTypeSpecs` group.
* Otherwise (hybrid): layers are bucketed by merge compatibility, and every bucket is split,
  in model order, into consecutive runs of equally many layers, so that groups whose slots
  have one shape (one pool) use its slots alike. The size is at most vLLM's (the smallest
  bucket's layer count, or the largest when under 1.5 times it, as vLLM 0.32 and 0.33): a
  pool's null block and rounding cost one block, and a state (Mamba) block of all its
  layers would be huge. Within a pool
  the size is lowered to split its buckets without short groups when that does not more
  than double their number (Nemotron-H: 54 Mamba layers in 6 groups of 9, not 5 of 10 and
  one of 4). Block sizes are never changed.

Layers whose spec needs no blocks per request (encoder-only attention) get no group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import InvalidFieldTypeError, MergeError, PlanError
from kvspec_core.planner.geometry import SlotShape, cell_shape, slot_shape
from kvspec_core.planner.layouts import KVCacheLayout
from kvspec_core.planner.plan_parts import specs_per_layer
from kvspec_core.planner.spec_answers import (
    check_spec_answers,
    check_uniformity_answer,
    checked_blocks_per_request,
    checked_merge,
)
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.uniform import UniformTypeSpecs

#: vLLM's rule (0.32, 0.33): buckets within this ratio of each other are padded to the largest.
_PAD_TO_LARGEST_RATIO = 1.5


@attrs.frozen
class GroupDraft:
    """A group before pools exist: layers in model order and the group's spec."""

    layers: tuple[str, ...]
    spec: KVSpec

    @property
    def layer_specs(self) -> tuple[KVSpec, ...]:
        return specs_per_layer(self.spec, len(self.layers))


def group_kind(spec: KVSpec, manager: PluginManager) -> str:
    """The registry kind a group of ``spec`` reports (a uniform-type wrapper: its members')."""
    if isinstance(spec, UniformTypeSpecs):
        return manager.spec_kinds.kind_of(spec.first_spec)
    return manager.spec_kinds.kind_of(spec)


def pool_key(draft: GroupDraft, layout: KVCacheLayout) -> tuple[object, ...]:
    """Groups with equal keys share a pool: same slot shapes, same residency."""
    runs = slot_runs(draft, layout)
    host = draft.layer_specs[0].host_resident
    if len({shape for shape, _ in runs}) == 1:
        return ("single", runs[0][0], host)
    return ("signature", runs, host)


def slot_runs(draft: GroupDraft, layout: KVCacheLayout) -> tuple[tuple[SlotShape, int], ...]:
    """The group's slot shapes in layer order as ``(shape, count)`` runs of equal shapes.

    A shape is computed once per distinct spec object: a merged group repeats one spec for
    every layer, and page sizes cost microseconds each, too much for 100,000 layers."""
    shapes: dict[int, SlotShape] = {}
    runs: list[list[Any]] = []
    for layer, spec in zip(draft.layers, draft.layer_specs, strict=True):
        shape = shapes.get(id(spec))
        if shape is None:
            shape = shapes[id(spec)] = slot_shape(cell_shape(spec, layer), layout)
        if runs and (runs[-1][0] is shape or runs[-1][0] == shape):
            runs[-1][1] += 1
        else:
            runs.append([shape, 1])
    return tuple((shape, count) for shape, count in runs)


def validate_layer_specs(layer_specs: Mapping[str, KVSpec], manager: PluginManager) -> None:
    """Refuse anything but a non-empty mapping of layer name -> registered spec whose
    answers the planner can use (each distinct spec object checked once)."""
    if not isinstance(layer_specs, Mapping):
        raise InvalidFieldTypeError(
            "plan_kv_cache",
            "layer_specs",
            type(layer_specs).__name__,
            "expected a mapping of layer name -> KVSpec",
        )
    if not layer_specs:
        raise PlanError("plan_kv_cache needs at least one layer spec; layer_specs is empty")
    for name, spec in layer_specs.items():
        if not isinstance(name, str) or not name:
            raise InvalidFieldTypeError(
                "plan_kv_cache", "layer_specs", name, "layer names must be non-empty strings"
            )
        if not isinstance(spec, KVSpec):
            raise InvalidFieldTypeError(
                "plan_kv_cache", f"layer_specs[{name!r}]", spec, "expected a KVSpec"
            )
        manager.spec_kinds.entry_of(spec)
    checked: set[int] = set()
    for name, spec in layer_specs.items():
        if id(spec) not in checked:
            check_spec_answers(spec, f"layer {name}")
            checked.add(id(spec))


def _group_name(layers: list[str]) -> str:
    return (
        f"layer {layers[0]}"
        if len(layers) == 1
        else f"the group of layers {layers[0]}..{layers[-1]} ({len(layers)} layers)"
    )


def _merge_buckets(names: list[str], specs: list[KVSpec]) -> list[tuple[list[str], KVSpec]]:
    """Bucket layers by spec equality, then combine buckets whose specs merge."""
    by_spec: dict[KVSpec, list[str]] = {}
    for name, spec in zip(names, specs, strict=True):
        by_spec.setdefault(spec, []).append(name)
    # (distinct specs, one layer naming each, all layers, merged spec)
    buckets: list[tuple[list[KVSpec], list[str], list[str], KVSpec]] = []
    for spec, layers in by_spec.items():
        for index, (members, member_names, bucket_layers, _) in enumerate(buckets):
            if type(members[0]) is not type(spec):
                continue
            try:
                merged = checked_merge(
                    type(spec),
                    [*members, spec],
                    [*member_names, layers[0]],
                    _group_name([*member_names, layers[0]]),
                )
            except MergeError:
                continue
            buckets[index] = (
                [*members, spec],
                [*member_names, layers[0]],
                bucket_layers + layers,
                merged,
            )
            break
        else:
            buckets.append(([spec], [layers[0]], list(layers), spec))
    order = {name: index for index, name in enumerate(names)}
    result = []
    for members, member_names, layers, merged in buckets:
        if len(members) == 1:
            merged = checked_merge(type(members[0]), members, member_names, _group_name(layers))
        check_spec_answers(merged, _group_name(layers))
        result.append((sorted(layers, key=order.__getitem__), merged))
    return result


def _placement(spec: KVSpec) -> tuple[bool, str, bool]:
    """What must agree among a group's layers beyond the spec type."""
    return (spec.host_resident, spec.group_role, spec.transferable)


def _class_group_size(counts: list[int], limit: int) -> int:
    """Group size for buckets sharing a pool: the largest size up to ``limit`` that splits
    every bucket without a short group (a short group leaves slots of its blocks unused),
    unless that would more than double the number of groups; then ``limit``."""
    common = math.gcd(*counts)
    best = max(size for size in range(1, min(common, limit) + 1) if common % size == 0)
    return best if 2 * best >= limit else limit


def _group_size(counts: list[int]) -> int:
    smallest, largest = min(counts), max(counts)
    if largest < smallest * _PAD_TO_LARGEST_RATIO:
        return largest
    return smallest


def group_layers(
    layer_specs: Mapping[str, KVSpec],
    manager: PluginManager,
    ctx: SizingContext,
    layout: KVCacheLayout,
) -> tuple[list[GroupDraft], list[str]]:
    """The groups of ``layer_specs`` and the layers that need no memory."""
    validate_layer_specs(layer_specs, manager)
    demands = {
        name: checked_blocks_per_request(spec, ctx, f"layer {name}")
        for name, spec in layer_specs.items()
    }
    memoryless = [name for name, demand in demands.items() if demand == 0]
    live = {name: spec for name, spec in layer_specs.items() if demands[name] != 0}
    if not live:
        return [], memoryless
    buckets = _merge_buckets(list(live), list(live.values()))
    if len(buckets) == 1:
        layers, spec = buckets[0]
        return [GroupDraft(tuple(layers), spec)], memoryless
    check_uniformity_answer(live, manager.spec_kinds)
    uniform = UniformTypeSpecs.from_specs(live, manager.spec_kinds)
    if uniform is not None and len({_placement(spec) for spec in live.values()}) == 1:
        return [GroupDraft(tuple(live), uniform)], memoryless
    limit = _group_size([len(layers) for layers, _ in buckets])
    classes: dict[tuple[object, ...], list[int]] = {}
    for index, (layers, spec) in enumerate(buckets):
        classes.setdefault(pool_key(GroupDraft(tuple(layers), spec), layout), []).append(index)
    size_of_bucket: dict[int, int] = {}
    for members in classes.values():
        size = _class_group_size([len(buckets[i][0]) for i in members], limit)
        size_of_bucket.update((index, size) for index in members)
    groups: list[GroupDraft] = []
    for index, (layers, spec) in enumerate(buckets):
        size = size_of_bucket[index]
        for start in range(0, len(layers), size):
            groups.append(GroupDraft(tuple(layers[start : start + size]), spec))
    return groups, memoryless
