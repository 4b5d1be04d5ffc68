"""Checking what a spec answers before the planner computes with it.

A plugin's spec is code the core does not control: a page size of 0 would divide by zero in
the budget split, a string would fail deep inside the geometry, a negative admission cap would
plan more requests than fit. Every protocol value the planner reads is checked here, at the
boundary, and a bad one is a :class:`SpecAnswerError` naming the spec class, its kind, the
method, the value, the layer and what the value must be;
:func:`kvspec_core.planner.plugin_faults.plugin_faults_named` adds the plugin and its
distribution.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from fractions import Fraction

import torch

from kvspec_core.context import SizingContext
from kvspec_core.errors import PluginError
from kvspec_core.plugins.registry import SpecRegistry
from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import MAX_FIELD_VALUE


class SpecAnswerError(PluginError):
    """A spec method returned a value the planner cannot use.

    ``spec_class``, ``method``, ``value`` and ``where`` (the layer or group) say which answer.
    """

    def __init__(
        self, spec_class: type[KVSpec], method: str, value: object, expected: str, where: str
    ) -> None:
        self.spec_class = spec_class
        self.method = method
        self.value = value
        self.expected = expected
        self.where = where
        super().__init__(self.describe())

    def describe(self) -> str:
        """The answer, what it must be, and where, without naming the plugin."""
        kind = getattr(self.spec_class, "kind", "") or self.spec_class.__name__
        return (
            f"{self.spec_class.__name__}.{self.method} of spec kind {kind!r} returned "
            f"{self.value!r} (type {type(self.value).__name__}) for {self.where}, but it must "
            f"be {self.expected}"
        )


def _is_int(value: object) -> bool:
    # bool is an int to Python, never a size to kvspec.
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: object) -> bool:
    return _is_int(value) and 1 <= value <= MAX_FIELD_VALUE  # type: ignore[operator]


def _non_negative(value: object) -> bool:
    return _is_int(value) and 0 <= value <= MAX_FIELD_VALUE  # type: ignore[operator]


_POSITIVE = "a positive int (at most 2**40)"
_NON_NEGATIVE = "a non-negative int (at most 2**40)"

_Answer = tuple[str, Callable[[object], bool], str]

#: (method, test, expectation) of the answers that decide which others are read.
_FIRST_ANSWERS: tuple[_Answer, ...] = (
    ("block_size", _positive, f"{_POSITIVE} of tokens per block"),
    ("has_layer_views", lambda value: isinstance(value, bool), "a bool"),
)

#: The answers every spec gives whatever its page geometry.
_ANSWERS: tuple[_Answer, ...] = (
    ("page_size_bytes", _positive, f"{_POSITIVE} of bytes per page"),
    (
        "block_stride_alignment",
        lambda value: value is None or _positive(value),
        f"None or {_POSITIVE} of bytes",
    ),
    ("host_resident", lambda value: isinstance(value, bool), "a bool"),
    ("transferable", lambda value: isinstance(value, bool), "a bool"),
    ("prefix_cacheable", lambda value: isinstance(value, bool), "a bool"),
    ("group_role", lambda value: isinstance(value, str) and bool(value), "a non-empty str"),
)

#: The answers of a spec whose pages the planner addresses as heads x states x content.
_VIEW_ANSWERS: tuple[_Answer, ...] = (
    ("num_heads", _positive, f"{_POSITIVE} of head slots"),
    (
        "tokens_per_state",
        lambda value: _is_int(value) or isinstance(value, Fraction),
        "an int or a Fraction of tokens (<= 0: one state per block)",
    ),
    ("num_states", _positive, f"{_POSITIVE} of states per page"),
    ("state_content_size_bytes", _positive, f"{_POSITIVE} of bytes per (head, state) cell"),
    ("unpadded_page_size_bytes", _positive, f"{_POSITIVE} of bytes of content per page"),
    (
        "view_dtype",
        lambda value: value is None or isinstance(value, torch.dtype),
        "None (raw bytes) or a torch.dtype",
    ),
)


def check_spec_answers(spec: KVSpec, where: str) -> None:
    """Refuse ``spec`` unless every protocol property the planner reads has a usable value;
    ``where`` names the layer or group in the error (``"layer model.layers.0"``)."""
    _check_answers(spec, _FIRST_ANSWERS, where)
    # The page geometry first: a page of 0 bytes is the fault of its 0-byte cell.
    if spec.has_layer_views:
        _check_answers(spec, _VIEW_ANSWERS, where)
    _check_answers(spec, _ANSWERS, where)


def _check_answers(spec: KVSpec, answers: tuple[_Answer, ...], where: str) -> None:
    for method, test, expected in answers:
        value = getattr(spec, method)
        if not test(value):
            raise SpecAnswerError(type(spec), method, value, expected, where)


def checked_blocks_per_request(spec: KVSpec, ctx: SizingContext, where: str) -> int:
    """``spec.max_blocks_per_request(ctx)``, refused unless a non-negative int."""
    value = spec.max_blocks_per_request(ctx)
    if not _non_negative(value):
        raise SpecAnswerError(
            type(spec),
            "max_blocks_per_request",
            value,
            f"{_NON_NEGATIVE} of blocks one request of max_model_len={ctx.max_model_len} holds",
            where,
        )
    return value


def checked_fixed_blocks(spec: KVSpec, ctx: SizingContext, where: str) -> int:
    """``spec.fixed_blocks_per_request(ctx)``, refused unless an int in ``[0,
    max_blocks_per_request]``."""
    value = spec.fixed_blocks_per_request(ctx)
    total = checked_blocks_per_request(spec, ctx, where)
    if not _non_negative(value) or value > total:
        raise SpecAnswerError(
            type(spec),
            "fixed_blocks_per_request",
            value,
            f"an int in [0, {total}] (of the blocks one request holds, those it holds "
            "whatever its length)",
            where,
        )
    return value


def checked_merge(
    spec_class: type[KVSpec], specs: list[KVSpec], layer_names: list[str], where: str
) -> KVSpec:
    """``spec_class.merge(specs, layer_names)``, refused unless it returns a ``spec_class``."""
    merged = spec_class.merge(specs, layer_names)
    if not isinstance(merged, spec_class):
        raise SpecAnswerError(
            spec_class,
            "merge",
            merged,
            f"an instance of {spec_class.__name__} (the merged spec)",
            where,
        )
    return merged


def check_uniformity_answer(specs: Mapping[str, KVSpec], registry: SpecRegistry) -> None:
    """Refuse a first spec whose ``is_uniform_with(specs, registry)`` is not a bool: any
    truthy object would put layers of different kinds in one uniform-type group."""
    name, first = next(iter(specs.items()))
    value = first.is_uniform_with(specs, registry)
    if not isinstance(value, bool):
        raise SpecAnswerError(
            type(first),
            "is_uniform_with",
            value,
            "a bool (whether the layers can share a uniform-type group)",
            f"layer {name} and the {len(specs) - 1} other layers",
        )
