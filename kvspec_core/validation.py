"""attrs validators that raise kvspec errors naming class, field, value and what is allowed.

Limits keep hostile configs (10^12 layers, overflowing products) from reaching an allocation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvspec_core.errors import InvalidFieldError, InvalidFieldTypeError

#: Upper bound for any count or size field: far above any real model, far below overflow.
MAX_FIELD_VALUE = 1 << 40

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _owner(instance: object) -> str:
    return type(instance).__name__


def _check_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidFieldTypeError(_owner(instance), attribute.name, value, "expected an int")
    return value


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An int in ``[1, MAX_FIELD_VALUE]``."""
    number = _check_int(instance, attribute, value)
    if not 1 <= number <= MAX_FIELD_VALUE:
        raise InvalidFieldError(
            _owner(instance), attribute.name, value, f"must be an int in [1, {MAX_FIELD_VALUE}]"
        )


def non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An int in ``[0, MAX_FIELD_VALUE]``."""
    number = _check_int(instance, attribute, value)
    if not 0 <= number <= MAX_FIELD_VALUE:
        raise InvalidFieldError(
            _owner(instance), attribute.name, value, f"must be an int in [0, {MAX_FIELD_VALUE}]"
        )


def non_empty_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A ``str`` with at least one non-blank character (a name users type)."""
    if not isinstance(value, str):
        raise InvalidFieldTypeError(_owner(instance), attribute.name, value, "expected a str")
    if not value.strip():
        raise InvalidFieldError(_owner(instance), attribute.name, value, "must not be blank")


def tuple_of(validator: Validator, description: str) -> Validator:
    """A tuple whose every item ``validator`` accepts (a bare str is refused, not iterated)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, tuple):
            raise InvalidFieldTypeError(_owner(instance), attribute.name, value, description)
        for item in value:
            validator(instance, attribute, item)

    return check


def optional(validator: Validator) -> Validator:
    """Accept ``None`` or what ``validator`` accepts."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is not None:
            validator(instance, attribute, value)

    return check


def is_bool(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A real ``bool`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise InvalidFieldTypeError(_owner(instance), attribute.name, value, "expected a bool")


def one_of(*allowed: object) -> Validator:
    """A value among ``allowed``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value not in allowed:
            raise InvalidFieldError(
                _owner(instance), attribute.name, value, f"must be one of {list(allowed)}"
            )

    return check


def instance_of(kind: type | tuple[type, ...], description: str) -> Validator:
    """An instance of ``kind``; ``description`` says what is allowed in words."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise InvalidFieldTypeError(_owner(instance), attribute.name, value, description)

    return check
