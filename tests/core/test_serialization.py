"""Spec serialisation: every torch dtype reads back; corrupt data is refused with kvspec errors."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch

from kvspec_core import PluginManager
from kvspec_core.errors import ConfigError, KVSpecError, UnknownNameError
from kvspec_core.kv_dtypes import BUILTIN_QUANT_MODES
from kvspec_core.specs import FullAttentionSpec, spec_from_dict, spec_to_dict


def full(**changes: Any) -> FullAttentionSpec:
    fields: dict[str, Any] = dict(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    fields.update(changes)
    return FullAttentionSpec(**fields)


def round_trip(spec: FullAttentionSpec) -> Any:
    return spec_from_dict(json.loads(json.dumps(spec_to_dict(spec))), PluginManager().spec_kinds)


@pytest.mark.parametrize(
    "dtype", [torch.int16, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.uint16]
)
def test_dtypes_outside_the_config_names_round_trip(dtype: torch.dtype) -> None:
    spec = full(dtype=dtype)
    restored = round_trip(spec)
    assert restored == spec and restored.dtype is dtype


def test_quant_mode_and_fraction_round_trip() -> None:
    spec = full(kv_quant_mode=BUILTIN_QUANT_MODES[5], tokens_per_state=Fraction(1, 4))
    assert round_trip(spec) == spec


_CORRUPTIONS: dict[str, tuple[Callable[[dict[str, Any]], Any], type[KVSpecError], str]] = {
    "fields not a dict": (lambda d: d.update(fields=[1]), ConfigError, "dict 'fields'"),
    "kind not a str": (lambda d: d.update(kind=["x"]), ConfigError, "str 'kind'"),
    "unknown field": (
        lambda d: d["fields"].update(bogus=1),
        ConfigError,
        r"FullAttentionSpec has unknown fields \['bogus'\]",
    ),
    "missing field": (
        lambda d: d["fields"].pop("head_size"),
        ConfigError,
        r"missing fields \['head_size'\]",
    ),
    "short fraction": (
        lambda d: d["fields"].update(tokens_per_state={"__fraction__": [1]}),
        ConfigError,
        "Fraction",
    ),
    "zero denominator": (
        lambda d: d["fields"].update(tokens_per_state={"__fraction__": [1, 0]}),
        ConfigError,
        "non-zero denominator",
    ),
    "dtype not a name": (
        lambda d: d["fields"].update(dtype={"__dtype__": 5}),
        UnknownNameError,
        "torch dtype",
    ),
    "dtype not a dtype": (
        lambda d: d["fields"].update(dtype={"__dtype__": "Tensor"}),
        UnknownNameError,
        "torch dtype",
    ),
    "quant mode field": (
        lambda d: d["fields"].update(kv_quant_mode={"__quant_mode__": {"nam": "x"}}),
        ConfigError,
        r"KVQuantMode has unknown fields \['nam'\]; missing fields \['name'\]",
    ),
}


@pytest.mark.parametrize("corruption", sorted(_CORRUPTIONS))
def test_corrupt_serialised_specs_are_refused_with_kvspec_errors(corruption: str) -> None:
    corrupt, error, message = _CORRUPTIONS[corruption]
    data = copy.deepcopy(spec_to_dict(full()))
    corrupt(data)
    with pytest.raises(error, match=message):
        spec_from_dict(data, PluginManager().spec_kinds)
