"""Reading a serialised KV-cache plan back: the plan is rebuilt from its groups and block
counts by the planner and must match what was written, so an edited or corrupted plan can
never mislay the cache. A function of the planner layer, not a method of
:class:`KVCachePlan`, because checking needs the planner and the planner builds plans."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import (
    ConfigError,
    InvalidFieldTypeError,
    KVSpecError,
    MissingFamilyError,
    PluginError,
)
from kvspec_core.planner.grouping import group_kind
from kvspec_core.planner.plan import KVCachePlan
from kvspec_core.planner.plan_document import check_plan_document
from kvspec_core.planner.plan_parts import (
    KVCacheTensor,
    PlannedGroup,
    PlannedTier,
    Pool,
    specs_per_layer,
)
from kvspec_core.planner.plan_writing import PLAN_FORMAT_VERSION, input_checksums
from kvspec_core.planner.planner import rebuild_with_blocks
from kvspec_core.planner.plugin_faults import plugin_faults_named
from kvspec_core.planner.spec_answers import check_spec_answers, checked_fixed_blocks
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.serialization import spec_from_dict


def plan_from_dict(data: Mapping[str, Any], manager: PluginManager) -> KVCachePlan:
    """Rebuild a plan written by :meth:`KVCachePlan.to_dict`; spec kinds resolve through
    ``manager``. A plan the planner would not have written (a field missing, of the wrong
    type or out of range, edited kinds, block counts, figures, tensors) is refused with a
    :class:`~kvspec_core.errors.ConfigError` naming the field; a spec whose plugin answers
    an unusable value or raises, with a :class:`~kvspec_core.errors.PluginError` naming it."""
    if not isinstance(manager, PluginManager):
        raise InvalidFieldTypeError(
            "plan_from_dict",
            "manager",
            manager,
            "expected a PluginManager (kvspec_core.load_plugins())",
        )
    if (
        isinstance(data, Mapping)
        and "format_version" in data
        and data["format_version"] != PLAN_FORMAT_VERSION
    ):
        raise ConfigError(
            f"plan format_version {data['format_version']!r} is not supported; this kvspec-core "
            f"reads version {PLAN_FORMAT_VERSION}"
        )
    check_plan_document(data)
    if "tiers" not in data:
        # A plan written before offload tiers existed: it has none.
        data = {**data, "tiers": []}
    if "kv_sharing" not in data:
        # A plan written before cross-layer KV sharing existed: no layer reads another's.
        data = {**data, "kv_sharing": []}
    groups = tuple(
        PlannedGroup(
            id=item["id"],
            kind=item["kind"],
            layers=item["layers"],
            spec=_group_spec(item["spec"], index, manager),
            pool=item["pool"],
            blocks_per_request=item["blocks_per_request"],
        )
        for index, item in enumerate(data["groups"])
    )
    if any("fixed_blocks_per_request" not in item for item in data["pools"]):
        # A plan written before fixed blocks were told apart: derived from its groups' specs
        # (its figures must still be what the planner gives now).
        data = {**data, "pools": _with_fixed_blocks(data, groups)}
    pools = tuple(
        Pool(
            id=item["id"],
            num_blocks=item["num_blocks"],
            block_bytes=item["block_bytes"],
            groups=item["groups"],
            host_resident=item["host_resident"],
            blocks_per_request=item["blocks_per_request"],
            fixed_blocks_per_request=item["fixed_blocks_per_request"],
            slot_bytes=item["slot_bytes"],
            alignment=item["alignment"],
            null_block=item["null_block"],
        )
        for item in data["pools"]
    )
    tensors = tuple(
        KVCacheTensor(
            size=item["size"],
            layers=item["layers"],
            layer_stride=item["layer_stride"],
            block_stride=item["block_stride"],
            offset=item["offset"],
            host_resident=item["host_resident"],
            pool=item["pool"],
            group=item["group"],
            shape=item["shape"],
            strides=item["strides"],
            raw=item["raw"],
        )
        for item in data["tensors"]
    )
    plan = KVCachePlan(
        groups=groups,
        pools=pools,
        tensors=tensors,
        layout=data["layout"],
        context=SizingContext(**data["context"]),
        budget_bytes=data["budget_bytes"],
        host_budget_bytes=data["host_budget_bytes"],
        bytes_allocated=data["bytes_allocated"],
        host_bytes_allocated=data["host_bytes_allocated"],
        bytes_padding=data["bytes_padding"],
        padding_breakdown=tuple(data["padding_breakdown"].items()),
        max_concurrency=float(data["max_concurrency"]),
        memoryless_layers=data["memoryless_layers"],
        tiers=tuple(
            PlannedTier(
                name=item["name"],
                budget_bytes=item["budget_bytes"],
                path=item["path"],
                blocks_per_pool=item["blocks_per_pool"],
                bytes_allocated=item["bytes_allocated"],
            )
            for item in data["tiers"]
        ),
        kv_sharing=[(item["layer"], item["source"]) for item in data["kv_sharing"]],
    )
    _check_tier_request(plan)
    _check_inputs_unedited(data)
    _check_consistent(plan, manager)
    _check_written_fields(data, plan.to_dict())
    return plan


def _with_fixed_blocks(
    data: Mapping[str, Any], groups: tuple[PlannedGroup, ...]
) -> list[dict[str, Any]]:
    """The document's pools, each with its groups' ``fixed_blocks_per_request``."""
    ctx = SizingContext(**data["context"])
    fixed: dict[int, int] = {}
    for group in groups:
        where = f"groups[{group.id}]"
        fixed[group.pool] = fixed.get(group.pool, 0) + checked_fixed_blocks(group.spec, ctx, where)
    return [
        {**item, "fixed_blocks_per_request": fixed.get(item["id"], 0)} for item in data["pools"]
    ]


def _group_spec(data: Any, index: int, manager: PluginManager) -> KVSpec:
    """The spec of group ``index``, read and its answers checked. A kind of a plugin that is
    not loaded stays a :class:`MissingFamilyError` (the fix is an install); any other
    refusal names the field."""
    try:
        spec = spec_from_dict(data, manager.spec_kinds)
    except MissingFamilyError:
        raise
    except KVSpecError as error:
        raise ConfigError(
            f"invalid KV-cache plan: field 'groups[{index}].spec' cannot be read: {error}; "
            "re-plan instead of editing a plan"
        ) from error
    with plugin_faults_named(manager, "reading a KV-cache plan"):
        # A uniform-type group's members are plugins' specs too.
        for member in {id(s): s for s in (spec, *specs_per_layer(spec, 1))}.values():
            check_spec_answers(member, f"group {index} of the plan")
    return spec


def _check_tier_request(plan: KVCachePlan) -> None:
    """Refuse tiers no :func:`plan_kv_cache` call could have asked for: one tier of each
    name at most, host before disk, a disk tier with its directory and a host tier
    without. The directory itself need not exist where the plan is read."""
    names = [tier.name for tier in plan.tiers]
    if names not in ([], ["host"], ["disk"], ["host", "disk"]):
        raise _edited("tiers", f"names tiers {names}; a plan holds at most host, then disk")
    for index, tier in enumerate(plan.tiers):
        if (tier.path is None) != (tier.name == "host") or (
            tier.path is not None and not os.path.isabs(tier.path)
        ):
            raise _edited(
                f"tiers[{index}].path",
                f"is {tier.path!r}; the disk tier names its directory as an absolute path "
                "and the host tier none",
            )


def _edited(field: str, why: str) -> ConfigError:
    return ConfigError(
        f"inconsistent KV-cache plan: field {field!r} {why}; re-plan instead of editing a plan"
    )


def _check_inputs_unedited(data: Mapping[str, Any]) -> None:
    """Refuse edits of the inputs nothing else derives from (block counts, budgets,
    memoryless layers, context, layout), told by their checksums."""
    written = data.get("input_checksums")
    if not isinstance(written, Mapping):
        raise _edited("input_checksums", "is missing; it is written by KVCachePlan.to_dict")
    for field, checksum in input_checksums(data).items():
        if written.get(field) != checksum:
            raise _edited(
                field,
                "was edited after the plan was written (its checksum in "
                "input_checksums does not match)",
            )


def _check_written_fields(written: Any, expected: Any, path: str = "") -> None:
    """Refuse a document whose every field, derived figures and flags included (total
    ``num_blocks``, group flags, ``needs_zeroing``...), is not what the plan read from it
    writes; the first differing field is named by its path (``groups[0].transferable``)."""
    if isinstance(expected, dict) and isinstance(written, Mapping):
        for key in written:
            if key not in expected:
                raise _edited(f"{path}{key}", "is not part of a KV-cache plan")
        for key, value in expected.items():
            if key not in written:
                raise _edited(f"{path}{key}", "is missing")
            _check_written_fields(written[key], value, f"{path}{key}.")
        return
    field = path.removesuffix(".")
    if isinstance(expected, list) and isinstance(written, list) and len(expected) == len(written):
        for index, (item, value) in enumerate(zip(written, expected, strict=True)):
            _check_written_fields(item, value, f"{field}[{index}].")
        return
    # Compared as JSON, so that 100.0 or 0 cannot stand in for 100 or False.
    if json.dumps(written, default=repr) != json.dumps(expected):
        raise _edited(
            field,
            f"is {written!r:.100} but the plan's groups and block counts give {expected!r:.100}",
        )


def _check_consistent(plan: KVCachePlan, manager: PluginManager) -> None:
    """Refuse a plan whose kinds, pools, tensors or figures do not follow from its groups
    and block counts (hand-edited or corrupted data would mislay the cache)."""
    for group in plan.groups:
        expected_kind = group_kind(group.spec, manager)
        if group.kind != expected_kind:
            raise ConfigError(
                f"inconsistent KV-cache plan: group {group.id} says kind {group.kind!r} but "
                f"its spec is of kind {expected_kind!r}; re-plan instead of editing a plan"
            )

    try:
        with plugin_faults_named(manager, "reading a KV-cache plan"):
            expected = rebuild_with_blocks(
                plan,
                [pool.num_blocks for pool in plan.pools],
                budget_bytes=plan.budget_bytes,
                host_budget_bytes=plan.host_budget_bytes,
            )
    except PluginError:
        raise
    except (KVSpecError, TypeError, ValueError, IndexError) as error:
        raise ConfigError(f"inconsistent KV-cache plan: {error}") from error
    # Compared as JSON too, so that 100.0 or 0 cannot stand in for 100 or False.
    expected_data, data = expected.to_dict(), plan.to_dict()
    for field in attrs.fields(type(plan)):
        name = field.name
        if getattr(expected, name) != getattr(plan, name) or (
            name in data and json.dumps(expected_data[name]) != json.dumps(data[name])
        ):
            raise ConfigError(
                f"inconsistent KV-cache plan: field {name!r} does not follow from its "
                f"groups and block counts (expected {getattr(expected, name)!r:.200}); "
                "re-plan instead of editing a plan"
            )
