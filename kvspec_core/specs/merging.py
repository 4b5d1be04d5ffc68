"""The generic merge rule: fields must agree, except declared ``any`` and optional fields."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, TypeVar

import attrs

from kvspec_core.errors import MergeError


class MergeableSpec(attrs.AttrsInstance, Protocol):
    """What the merge rule reads of a spec class (:class:`~kvspec_core.KVSpec` has it; this
    module sits beneath the spec protocol and does not import it)."""

    merge_any_fields: ClassVar[frozenset[str]]
    merge_optional_fields: ClassVar[frozenset[str]]


SpecT = TypeVar("SpecT", bound=MergeableSpec)


def _layer_label(layer_names: Sequence[str], index: int) -> str:
    return layer_names[index] if index < len(layer_names) else f"#{index}"


def _disagreement(
    field: str, specs: Sequence[Any], values: Sequence[Any], layer_names: Sequence[str]
) -> MergeError:
    by_value: dict[str, list[str]] = {}
    for index, value in enumerate(values):
        by_value.setdefault(repr(value), []).append(_layer_label(layer_names, index))
    detail = "; ".join(
        f"{value} in {', '.join(layers[:4])}{' ...' if len(layers) > 4 else ''}"
        for value, layers in by_value.items()
    )
    kinds = sorted({type(spec).__name__ for spec in specs})
    return MergeError(
        f"layers cannot share one KV cache group: field {field!r} differs ({detail}) "
        f"among {'/'.join(kinds)} specs; give them the same {field} or plan them in separate "
        "groups"
    )


def require_class(cls: type, specs: Sequence[Any], layer_names: Sequence[str]) -> None:
    """Every spec must be exactly of class ``cls``."""
    for index, spec in enumerate(specs):
        if type(spec) is not cls:
            raise MergeError(
                f"layers cannot share one KV cache group: layer "
                f"{_layer_label(layer_names, index)} is a {type(spec).__name__}, not a "
                f"{cls.__name__}"
            )


def merge_by_rules(cls: type[SpecT], specs: Sequence[SpecT], layer_names: Sequence[str]) -> SpecT:
    """Merge ``specs`` of class ``cls``: every field equal, except ``cls.merge_any_fields``
    (combined with ``any``) and ``cls.merge_optional_fields`` (unset values ignored)."""
    if not specs:
        raise MergeError(f"cannot merge an empty list of {cls.__name__} specs")
    require_class(cls, specs, layer_names)
    changes: dict[str, Any] = {}
    for attribute in attrs.fields(cls):
        name = attribute.name
        values = [getattr(spec, name) for spec in specs]
        if name in cls.merge_any_fields:
            changes[name] = any(values)
            continue
        if name in cls.merge_optional_fields:
            set_values = [value for value in values if value is not None]
            if any(value != set_values[0] for value in set_values[1:]):
                raise _disagreement(name, specs, values, layer_names)
            changes[name] = set_values[0] if set_values else None
            continue
        if any(value != values[0] for value in values[1:]):
            raise _disagreement(name, specs, values, layer_names)
    # The mypy attrs plugin cannot evolve a type variable; the value is an attrs spec.
    first: Any = specs[0]
    merged: SpecT = attrs.evolve(first, **changes)
    return merged
