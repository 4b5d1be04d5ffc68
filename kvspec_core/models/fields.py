"""Typed reads of model-config fields; a bad or missing field is refused naming it and the fix."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

import torch

from kvspec_core.dtypes import dtype_from_name
from kvspec_core.errors import ConfigError, UnknownNameError
from kvspec_core.validation import MAX_FIELD_VALUE

#: Most layers a config may declare: about 80x the deepest published model (Llama-3.1-405B
#: has 126 layers, Nemotron-H-56B 118), and low enough that a config at the limit is typed
#: and planned in well under a second (benchmarks/plan_many_layers.py); a hostile
#: ``num_hidden_layers: 10**12`` is refused before any allocation.
MAX_LAYERS = 10_000

#: Dtype assumed when a config names none (neither ``torch_dtype`` nor ``dtype``). Hugging
#: Face would load float32 weights, but every published LLM checkpoint serves in 16 bits and
#: engines default to bfloat16 for such configs, so a KV-cache plan does the same.
DEFAULT_MODEL_DTYPE = torch.bfloat16

#: Config fields naming the model's dtype, in priority order (newer transformers write
#: ``dtype``; older ones ``torch_dtype``).
DTYPE_FIELDS = ("torch_dtype", "dtype")


class MissingConfigFieldError(ConfigError):
    """A field the model config leaves out and nothing filled (see
    :mod:`kvspec_core.models.normalized`); ``fields`` names the spellings looked for."""

    def __init__(self, message: str, *, fields: tuple[str, ...]) -> None:
        super().__init__(message)
        self.fields = fields


def missing_field(
    *fields: str, needed_for: str, fix: str = "add it to the model config"
) -> MissingConfigFieldError:
    """The error for a config that sets none of ``fields`` (needed for ``needed_for``)."""
    names = " or ".join(repr(f) for f in fields)
    return MissingConfigFieldError(
        f"config field {names} is missing (needed for {needed_for}); {fix}", fields=fields
    )


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def first_present(config: Mapping[str, Any], *fields: str) -> tuple[str, Any] | None:
    """The first of ``fields`` set (not ``None``) in ``config``, with its name."""
    for field in fields:
        value = config.get(field)
        if value is not None:
            return field, value
    return None


def int_field(
    config: Mapping[str, Any],
    field: str,
    value: object,
    *,
    minimum: int = 1,
    maximum: int = MAX_FIELD_VALUE,
    needed_for: str = "",
) -> int:
    """``value`` (read from ``config[field]``) as an int in ``[minimum, maximum]``."""
    if not is_int(value) or not minimum <= value <= maximum:
        purpose = f" (needed for {needed_for})" if needed_for else ""
        raise ConfigError(
            f"config field {field!r} is {value!r}{purpose}; it must be an int in "
            f"[{minimum}, {maximum}]. Fix {field!r} in the model config"
        )
    return int(value)


def require_int(
    config: Mapping[str, Any],
    *fields: str,
    needed_for: str,
    minimum: int = 1,
    maximum: int = MAX_FIELD_VALUE,
) -> int:
    """The first of ``fields`` present, as a bounded int; missing ones are refused by name."""
    found = first_present(config, *fields)
    if found is None:
        raise missing_field(*fields, needed_for=needed_for)
    field, value = found
    return int_field(config, field, value, minimum=minimum, maximum=maximum, needed_for=needed_for)


def optional_int(
    config: Mapping[str, Any],
    *fields: str,
    needed_for: str,
    minimum: int = 1,
    maximum: int = MAX_FIELD_VALUE,
) -> int | None:
    """Like :func:`require_int`, but ``None`` when none of ``fields`` is present."""
    if first_present(config, *fields) is None:
        return None
    return require_int(config, *fields, needed_for=needed_for, minimum=minimum, maximum=maximum)


def model_dtype(
    config: Mapping[str, Any], fallback: Mapping[str, Any] | None = None
) -> torch.dtype:
    """The model's dtype from ``torch_dtype``/``dtype`` of ``config`` (then ``fallback``, the
    outer config of a multimodal model); :data:`DEFAULT_MODEL_DTYPE` when neither names one."""
    found = first_present(config, *DTYPE_FIELDS)
    if found is None and fallback is not None:
        found = first_present(fallback, *DTYPE_FIELDS)
    if found is None or found[1] == "auto":
        return DEFAULT_MODEL_DTYPE
    field, value = found
    if not isinstance(value, str):
        raise ConfigError(
            f"config field {field!r} is {value!r}; it must be a dtype name such as 'bfloat16'"
        )
    try:
        return dtype_from_name(value)
    except UnknownNameError as error:
        raise ConfigError(f"config field {field!r}: {error}") from None
