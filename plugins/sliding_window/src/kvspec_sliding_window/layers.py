"""Turning a ``sliding_attention`` model layer into a :class:`SlidingWindowSpec`."""

from __future__ import annotations

from typing import Any

from kvspec_core.errors import ConfigError
from kvspec_core.models.layer import LayerConfig
from kvspec_core.validation import MAX_FIELD_VALUE

from kvspec_sliding_window.specs import SlidingWindowSpec

#: The normalised layer type this family claims.
SLIDING_LAYER_TYPE = "sliding_attention"
#: Config field holding the window, in tokens.
WINDOW_FIELD = "sliding_window"


def attention_fields(layer: LayerConfig) -> dict[str, Any]:
    """The attention-geometry fields of ``layer``'s spec, from the core's resolved shape."""
    shape = layer.attention
    if shape is None:
        raise ConfigError(
            f"layer {layer.name} is a {layer.layer_type} layer but the config gives no attention "
            "geometry (num_key_value_heads / head_dim); fix the model config"
        )
    return dict(
        block_size=layer.options.block_size,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        head_size_v=shape.head_size_v,
        dtype=shape.dtype,
        kv_quant_mode=shape.kv_quant_mode,
        max_tp_shards=shape.total_kv_heads,
    )


def window_of(layer: LayerConfig) -> int:
    """The layer's window from the config's ``sliding_window``; refused unless a positive int."""
    window = layer.config.get(WINDOW_FIELD)
    if isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= MAX_FIELD_VALUE:
        raise ConfigError(
            f"layer {layer.name} is a sliding-window layer but config field {WINDOW_FIELD!r} is "
            f"{window!r}; it must be a positive int (tokens each query attends to). Set "
            f"{WINDOW_FIELD!r} in the config, or type the layer as full attention"
        )
    return window


def sliding_window_spec(layer: LayerConfig) -> SlidingWindowSpec | None:
    """The spec of ``layer`` if it is a sliding-window layer, else ``None``."""
    if layer.layer_type != SLIDING_LAYER_TYPE:
        return None
    return SlidingWindowSpec(sliding_window=window_of(layer), **attention_fields(layer))
