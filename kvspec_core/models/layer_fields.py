"""Reading the config fields layer typing shares: the layer count, per-layer lists, and the
scalar pattern fields (bounded, refused by name before transformers derives ``layer_types``
from them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvspec_core.errors import ConfigError
from kvspec_core.models.fields import (
    MAX_LAYERS,
    first_present,
    int_field,
    missing_field,
    optional_int,
    require_int,
)
from kvspec_core.validation import MAX_FIELD_VALUE

#: Scalar pattern fields -> (minimum, maximum, what they decide). transformers' config classes
#: derive ``layer_types`` from them (Qwen3-Next's ``full_attention_interval``, Gemma's
#: ``sliding_window_pattern``...), and a derived ``layer_types`` takes priority here, so
#: :func:`check_pattern_fields` applies these bounds to the file's values *before* transformers
#: reads them: a value kvspec refuses must not become a plausible derived typing.
PATTERN_INT_FIELDS: Mapping[str, tuple[int, int, str]] = {
    "full_attention_interval": (1, MAX_FIELD_VALUE, "Qwen3-Next-style layer typing"),
    "attn_layer_period": (1, MAX_FIELD_VALUE, "Jamba-style layer typing"),
    "attn_layer_offset": (0, MAX_FIELD_VALUE, "Jamba-style layer typing"),
    "sliding_window_pattern": (1, MAX_FIELD_VALUE, "which layers slide"),
    "_sliding_window_pattern": (1, MAX_FIELD_VALUE, "which layers slide"),
    "max_window_layers": (0, MAX_LAYERS, "which layers slide"),
    "no_rope_layer_interval": (1, MAX_FIELD_VALUE, "the global layers of chunked attention"),
}

#: Per-layer fields whose length gives the layer count when the config states none.
_PER_LAYER_FIELDS = ("layer_types", "layers_block_type", "hybrid_override_pattern")


def num_layers(config: Mapping[str, Any]) -> int:
    """Decoder layer count: ``num_hidden_layers`` (or ``n_layer`` / ``n_layers``
    / ``num_layers``), else the
    length of ``layer_types`` (or ``layers_block_type`` / ``hybrid_override_pattern``, which
    transformers 5 counts Nemotron-H's layers from); bounded by :data:`MAX_LAYERS`."""
    declared = optional_int(
        config,
        "num_hidden_layers",
        "n_layer",
        "n_layers",
        "num_layers",
        needed_for="the number of layers",
        maximum=MAX_LAYERS,
    )
    if declared is not None:
        return declared
    for field in _PER_LAYER_FIELDS:
        per_layer = config.get(field)
        if isinstance(per_layer, (list, str)) and per_layer:
            return int_field(config, field, len(per_layer), maximum=MAX_LAYERS)
    raise missing_field("num_hidden_layers", needed_for="the number of layers")


def per_layer_list(config: Mapping[str, Any], field: str, count: int) -> Sequence[Any]:
    """``config[field]``: a list (or string) of one entry per layer, else refused by name."""
    values = config[field]
    if not isinstance(values, (list, str)) or len(values) != count:
        length = len(values) if isinstance(values, (list, str)) else "not a list"
        raise ConfigError(
            f"config field {field!r} must give one entry per layer: num_hidden_layers is "
            f"{count} but {field!r} has {length}; fix {field!r} or 'num_hidden_layers'"
        )
    return values


def pattern_int(config: Mapping[str, Any], *fields: str, maximum: int | None = None) -> int:
    """The first of ``fields`` (pattern fields of :data:`PATTERN_INT_FIELDS`) present, within
    its bounds (``maximum`` narrowing the table's); missing ones are refused by name."""
    found = first_present(config, *fields)
    minimum, table_maximum, needed_for = PATTERN_INT_FIELDS[found[0] if found else fields[0]]
    return require_int(
        config,
        *fields,
        needed_for=needed_for,
        minimum=minimum,
        maximum=table_maximum if maximum is None else maximum,
    )


def sliding_switch(config: Mapping[str, Any]) -> bool | None:
    """``use_sliding_window``: ``None`` when absent, else a JSON boolean (refused otherwise)."""
    switch = config.get("use_sliding_window")
    if switch is not None and not isinstance(switch, bool):
        raise ConfigError(
            f"config field 'use_sliding_window' is {switch!r}; it must be true or false (JSON "
            "booleans). Fix 'use_sliding_window' in the model config"
        )
    return switch


def check_pattern_fields(config: Mapping[str, Any]) -> None:
    """Refuse a present pattern field (:data:`PATTERN_INT_FIELDS`, ``use_sliding_window``)
    whose value kvspec's typing would refuse, naming the field and the fix. Run on the file's
    own values before transformers derives ``layer_types`` from them (where ``True``, 1.5,
    -1 or NaN would yield a plausible but wrong typing)."""
    for field in PATTERN_INT_FIELDS:
        if config.get(field) is not None:
            pattern_int(config, field)
    sliding_switch(config)
