"""Refusing a config's ``model_type`` and RoPE fields when their value is of a kind no
engine reads, before anything is derived from them: a ``model_type`` that is not a name
would silently skip transformers' defaults, and a ``rope_scaling`` that is not an object (or
a ``factor`` that is not a number) would silently leave the default length unscaled."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvspec_core.errors import ConfigError

#: The config fields holding RoPE parameters (transformers' older and newer names).
ROPE_FIELDS = ("rope_scaling", "rope_parameters")


def is_scaling_factor(value: object) -> bool:
    """Whether ``value`` is a usable RoPE scaling factor: a finite positive number."""
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _check_factor(field: str, params: Mapping[str, Any]) -> None:
    factor = params.get("factor")
    if factor is not None and not is_scaling_factor(factor):
        raise ConfigError(
            f"config field '{field}.factor' is {factor!r}; it must be a positive number (the "
            f"RoPE scaling factor). Fix '{field}' in the model config"
        )


def check_model_type_and_rope(config: Mapping[str, Any], where: str = "") -> None:
    """Refuse a present ``model_type`` that is not a non-empty string, and a present
    ``rope_scaling`` / ``rope_parameters`` that is not an object of parameters (or one per
    layer type) with a numeric ``factor``. ``where``: a prefix for nested configs
    (``text_config.``)."""
    model_type = config.get("model_type")
    if model_type is not None and (not isinstance(model_type, str) or not model_type):
        raise ConfigError(
            f"config field '{where}model_type' is {model_type!r}; it must be the "
            'architecture\'s name as a string (e.g. "llama"). Fix it in the model config'
        )
    for name in ROPE_FIELDS:
        value = config.get(name)
        if value is None:
            continue
        field = f"{where}{name}"
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"config field '{field}' is {value!r}; it must be an object of RoPE "
                'parameters (e.g. {"rope_type": "linear", "factor": 2.0}) or null. '
                "Fix it in the model config"
            )
        if "rope_type" in value or "type" in value or "factor" in value:
            _check_factor(field, value)
            continue
        for layer_type, params in value.items():
            if isinstance(params, Mapping):
                _check_factor(f"{field}.{layer_type}", params)
