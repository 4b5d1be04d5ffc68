"""The shape of a serialised KV-cache plan: every field's type and range, and the ids its
groups, pools and tensors refer to, checked before any of it is used.

:func:`~kvspec_core.planner.plan_from_dict` then rebuilds the plan and compares it with the
document, which catches values of the right shape that do not follow from the plan's inputs.
Without this check a value of the wrong shape failed inside that rebuild instead: a pool's
``blocks_per_request`` of 0 divided by zero, a string where a count belongs was a
``TypeError`` naming no field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import attrs

from kvspec_core.context import SizingContext
from kvspec_core.errors import ConfigError
from kvspec_core.planner.plan_parts import TIER_NAMES

#: Largest int any field of a plan may hold: far above any machine's bytes or blocks, far
#: below what would overflow the int64 strides of the views built from it.
MAX_PLAN_INT = 1 << 62

#: ``check(value, path)`` raises :class:`ConfigError` naming ``path`` unless ``value`` fits.
Check = Callable[[Any, str], None]


def invalid_field(path: str, value: object, expected: str) -> ConfigError:
    """The error for field ``path`` (``pools[0].blocks_per_request``; ``""``: the whole
    document) holding ``value``."""
    # The document itself has no field name: "field ''" would leave the user guessing.
    what = f"field {path!r}" if path else "the document"
    return ConfigError(
        f"invalid KV-cache plan: {what} is {value!r:.100} (type "
        f"{type(value).__name__}), but it must be {expected}; pass a plan written by "
        "KVCachePlan.to_dict, and re-plan instead of editing a plan"
    )


def _int(low: int) -> Check:
    expected = f"an int in [{low}, 2**62]"

    def check(value: Any, path: str) -> None:
        # bool is an int to Python, never a count to a plan.
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not low <= value <= MAX_PLAN_INT
        ):
            raise invalid_field(path, value, expected)

    return check


def _strides(value: Any, path: str) -> None:
    """A stride: an int of either sign within the plan's bound."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not -MAX_PLAN_INT <= value <= MAX_PLAN_INT
    ):
        raise invalid_field(path, value, "an int in [-2**62, 2**62]")


def _bool(value: Any, path: str) -> None:
    if not isinstance(value, bool):
        raise invalid_field(path, value, "a bool (true or false)")


def _str(value: Any, path: str) -> None:
    if not isinstance(value, str) or not value:
        raise invalid_field(path, value, "a non-empty str")


def _number(value: Any, path: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise invalid_field(path, value, "a finite non-negative number")


def _optional(check: Check) -> Check:
    def optional(value: Any, path: str) -> None:
        if value is not None:
            check(value, path)

    return optional


def _list_of(check: Check, *, non_empty: bool = False) -> Check:
    expected = "a non-empty list" if non_empty else "a list"

    def list_of(value: Any, path: str) -> None:
        if not isinstance(value, list) or (non_empty and not value):
            raise invalid_field(path, value, expected)
        for index, item in enumerate(value):
            check(item, f"{path}[{index}]")

    return list_of


def _mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or not all(isinstance(key, str) for key in value):
        raise invalid_field(path, value, "a mapping with str keys (a JSON object)")
    return value


def _object(value: Any, path: str) -> None:
    """A JSON object; what it holds is checked by whoever reads it (a spec's kind)."""
    _mapping(value, path)


def _mapping_of(check: Check) -> Check:
    def mapping_of(value: Any, path: str) -> None:
        for key, item in _mapping(value, path).items():
            check(item, f"{path}.{key}")

    return mapping_of


def _record(fields: Mapping[str, Check], *, optional: frozenset[str] = frozenset()) -> Check:
    """A mapping holding every one of ``fields`` but the ``optional`` ones (further keys are
    left to the comparison with the rebuilt plan, which names them)."""

    def record(value: Any, path: str) -> None:
        mapping = _mapping(value, path)
        for name, check in fields.items():
            where = f"{path}.{name}" if path else name
            if name not in mapping and name in optional:
                continue
            if name not in mapping:
                raise ConfigError(
                    f"invalid KV-cache plan: field {where!r} is missing; pass a plan written by "
                    "KVCachePlan.to_dict, and re-plan instead of editing a plan"
                )
            check(mapping[name], where)

    return record


def _context(value: Any, path: str) -> None:
    """A :class:`SizingContext` as ``attrs.asdict`` writes it, each field named on refusal."""
    mapping = _mapping(value, path)
    names = {field.name for field in attrs.fields(SizingContext)}
    for key in mapping:
        if key not in names:
            raise invalid_field(
                f"{path}.{key}",
                mapping[key],
                f"absent: SizingContext has no such field (its fields: {', '.join(sorted(names))})",
            )
    try:
        SizingContext(**mapping)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        field = getattr(error, "field", None)
        where = f"{path}.{field}" if isinstance(field, str) else path
        raise invalid_field(
            where,
            mapping.get(field, value) if isinstance(field, str) else value,
            f"a valid sizing context value ({error})",
        ) from error


_GROUP = _record(
    {
        "id": _int(0),
        "kind": _str,
        "layers": _list_of(_str, non_empty=True),
        "block_size": _int(1),
        "page_size_bytes": _int(1),
        "pool": _int(0),
        # A layer needing no block is memoryless, never in a group.
        "blocks_per_request": _int(1),
        "host_resident": _bool,
        "role": _str,
        "transferable": _bool,
        "prefix_cacheable": _bool,
        "spec": _object,
    }
)

_POOL = _record(
    {
        "id": _int(0),
        "num_blocks": _int(1),
        "block_bytes": _int(1),
        "groups": _list_of(_int(0), non_empty=True),
        "host_resident": _bool,
        "blocks_per_request": _int(1),
        "fixed_blocks_per_request": _int(0),
        "slot_bytes": _list_of(_int(1), non_empty=True),
        "alignment": _int(1),
        "null_block": _int(0),
        "max_concurrency": _number,
    },
    # Plans written before fixed blocks were told apart hold none (0 when read back).
    optional=frozenset({"fixed_blocks_per_request"}),
)

_TENSOR = _record(
    {
        "size": _int(0),
        "layers": _list_of(_str, non_empty=True),
        "layer_stride": _strides,
        "block_stride": _strides,
        "offset": _int(0),
        "host_resident": _bool,
        "pool": _int(0),
        "group": _int(0),
        "shape": _list_of(_int(0), non_empty=True),
        "strides": _list_of(_strides, non_empty=True),
        "raw": _bool,
    }
)


def _tier_name(value: Any, path: str) -> None:
    if value not in TIER_NAMES:
        raise invalid_field(path, value, f"one of {', '.join(map(repr, TIER_NAMES))}")


_TIER = _record(
    {
        "name": _tier_name,
        "budget_bytes": _int(1),
        "path": _optional(_str),
        "blocks_per_pool": _list_of(_int(0)),
        "bytes_allocated": _int(0),
    }
)

_PLAN = _record(
    {
        "format_version": _int(0),
        "layout": _str,
        "context": _context,
        "budget_bytes": _int(0),
        "host_budget_bytes": _optional(_int(0)),
        "num_blocks": _int(0),
        "bytes_allocated": _int(0),
        "host_bytes_allocated": _int(0),
        "bytes_padding": _int(0),
        "padding_breakdown": _mapping_of(_int(0)),
        "max_concurrency": _number,
        "memoryless_layers": _list_of(_str),
        "has_mixed_precision": _bool,
        "needs_zeroing": _bool,
        "transfer_group_ids": _list_of(_int(0)),
        "host_group_ids": _list_of(_int(0)),
        "aliases": _list_of(_record({"pool": _int(0), "groups": _list_of(_int(0))})),
        "groups": _list_of(_GROUP),
        "pools": _list_of(_POOL),
        "tensors": _list_of(_TENSOR),
        "tiers": _list_of(_TIER),
        "kv_sharing": _list_of(_record({"layer": _str, "source": _str})),
        "input_checksums": _mapping_of(_str),
    },
    # Plans written before offload tiers (or cross-layer KV sharing) existed have none.
    optional=frozenset({"tiers", "kv_sharing"}),
)


def _check_ids(items: Sequence[Mapping[str, Any]], name: str) -> None:
    for index, item in enumerate(items):
        if item["id"] != index:
            raise invalid_field(
                f"{name}[{index}].id", item["id"], f"{index}, its position in {name}"
            )


def _check_reference(value: int, path: str, count: int, name: str) -> None:
    if value >= count:
        raise invalid_field(path, value, f"the index of one of the plan's {count} {name}")


def check_plan_document(data: object) -> None:
    """Refuse ``data`` unless every field a :class:`KVCachePlan` document holds is present,
    of its type and in its range, and every group, pool and tensor id it refers to exists;
    the :class:`ConfigError` names the field (``pools[0].blocks_per_request``)."""
    _PLAN(data, "")
    document = cast(Mapping[str, Any], data)  # _PLAN refused anything else
    groups, pools = document["groups"], document["pools"]
    _check_ids(groups, "groups")
    _check_ids(pools, "pools")
    for index, group in enumerate(groups):
        _check_reference(group["pool"], f"groups[{index}].pool", len(pools), "pools")
    for index, pool in enumerate(pools):
        for position, group_id in enumerate(pool["groups"]):
            _check_reference(group_id, f"pools[{index}].groups[{position}]", len(groups), "groups")
    for index, tensor in enumerate(document["tensors"]):
        _check_reference(tensor["pool"], f"tensors[{index}].pool", len(pools), "pools")
        _check_reference(tensor["group"], f"tensors[{index}].group", len(groups), "groups")
    for index, tier in enumerate(document.get("tiers", [])):
        if len(tier["blocks_per_pool"]) != len(pools):
            raise invalid_field(
                f"tiers[{index}].blocks_per_pool",
                tier["blocks_per_pool"],
                f"one block count per pool of the plan ({len(pools)})",
            )
