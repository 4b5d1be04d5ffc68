"""Specs as plain JSON-able data and back, through the registry's kind names."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import attrs
import torch

from kvspec_core.dtypes import dtype_from_written_name, dtype_name
from kvspec_core.errors import ConfigError
from kvspec_core.kv_dtypes import KVQuantMode
from kvspec_core.specs.base import KVSpec, SpecKinds


def _encode(value: Any) -> Any:
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


def _decode(value: Any, registry: SpecKinds) -> Any:
    if isinstance(value, list):
        return tuple(_decode(item, registry) for item in value)
    if isinstance(value, dict):
        if "kind" in value and "fields" in value:
            return spec_from_dict(value, registry)
        if "__dtype__" in value:
            return dtype_from_written_name(value["__dtype__"])
        if "__fraction__" in value:
            return _decode_fraction(value["__fraction__"])
        if "__quant_mode__" in value:
            encoded = value["__quant_mode__"]
            if not isinstance(encoded, dict):
                raise ConfigError(f"not a serialised KVQuantMode: {encoded!r}")
            return _construct(
                KVQuantMode, {k: _decode(v, registry) for k, v in encoded.items()}, "quant mode"
            )
    return value


def _decode_fraction(encoded: Any) -> Fraction:
    if (
        not isinstance(encoded, list)
        or len(encoded) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in encoded)
        or encoded[1] == 0
    ):
        raise ConfigError(
            f"not a serialised Fraction (needs [numerator, non-zero denominator]): {encoded!r}"
        )
    return Fraction(encoded[0], encoded[1])


def _construct(cls: type[Any], fields: dict[str, Any], what: str) -> Any:
    """``cls(**fields)``, refusing unknown and missing field names with a kvspec error
    (attrs would raise a bare TypeError) so a corrupt plan file names what is wrong."""
    init_fields = [attribute for attribute in attrs.fields(cls) if attribute.init]
    known = {attribute.name for attribute in init_fields}
    unknown = sorted(set(fields) - known)
    missing = sorted(
        attribute.name
        for attribute in init_fields
        if attribute.default is attrs.NOTHING and attribute.name not in fields
    )
    if unknown or missing:
        raise ConfigError(
            f"serialised {what} {cls.__name__} has "
            + "; ".join(
                part
                for part in (
                    f"unknown fields {unknown}" if unknown else "",
                    f"missing fields {missing}" if missing else "",
                )
                if part
            )
            + f"; its fields are {sorted(known)}"
        )
    return cls(**fields)


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


def spec_from_dict(data: dict[str, Any], registry: SpecKinds) -> KVSpec:
    """Rebuild a spec written by :func:`spec_to_dict`; its kind must be registered."""
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("kind"), str)
        or not isinstance(data.get("fields"), dict)
    ):
        raise ConfigError(
            f"not a serialised spec (needs a str 'kind' and a dict 'fields'): {data!r}"
        )
    cls = registry.class_of(data["kind"])
    fields = {name: _decode(value, registry) for name, value in data["fields"].items()}
    return _construct(cls, fields, f"spec of kind {data['kind']!r}:")
