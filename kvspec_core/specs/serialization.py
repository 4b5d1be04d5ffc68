"""Specs as plain JSON-able data and back, through the registry's kind names."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kvspec_core.dtypes import dtype_from_name, dtype_name
from kvspec_core.errors import ConfigError
from kvspec_core.kv_dtypes import KVQuantMode

if TYPE_CHECKING:
    from kvspec_core.plugins.registry import SpecRegistry
    from kvspec_core.specs.base import KVSpec


def _encode(value: Any) -> Any:
    from kvspec_core.specs.base import KVSpec

    if isinstance(value, KVSpec):
        return spec_to_dict(value)
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, Fraction):
        return {"__fraction__": [value.numerator, value.denominator]}
    if isinstance(value, KVQuantMode):
        return {"__quant_mode__": {k: _encode(v) for k, v in attrs.asdict(value).items()}}
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


def _decode(value: Any, registry: SpecRegistry) -> Any:
    if isinstance(value, list):
        return tuple(_decode(item, registry) for item in value)
    if isinstance(value, dict):
        if "kind" in value and "fields" in value:
            return spec_from_dict(value, registry)
        if "__dtype__" in value:
            return dtype_from_name(value["__dtype__"])
        if "__fraction__" in value:
            numerator, denominator = value["__fraction__"]
            return Fraction(numerator, denominator)
        if "__quant_mode__" in value:
            return KVQuantMode(**{k: _decode(v, registry) for k, v in value["__quant_mode__"].items()})
    return value


def spec_to_dict(spec: KVSpec) -> dict[str, Any]:
    """``{"kind": ..., "fields": {...}}`` with only JSON types inside."""
    return {
        "kind": type(spec).kind,
        "fields": {
            attribute.name: _encode(getattr(spec, attribute.name))
            for attribute in attrs.fields(type(spec))
            if attribute.init
        },
    }


def spec_from_dict(data: dict[str, Any], registry: SpecRegistry) -> KVSpec:
    """Rebuild a spec written by :func:`spec_to_dict`; its kind must be registered."""
    if not isinstance(data, dict) or "kind" not in data or "fields" not in data:
        raise ConfigError(f"not a serialised spec (needs 'kind' and 'fields'): {data!r}")
    cls = registry.class_of(data["kind"])
    fields = {name: _decode(value, registry) for name, value in data["fields"].items()}
    return cls(**fields)
