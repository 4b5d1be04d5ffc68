"""Turning a ``sliding_attention`` model layer into a :class:`SlidingWindowSpec`."""

from __future__ import annotations


from kvspec_core.errors import ConfigError
from kvspec_core.models.layer import LayerConfig
from kvspec_core.validation import MAX_FIELD_VALUE

from kvspec_sliding_window.specs import SlidingWindowSpec

#: The normalised layer type this family claims.
SLIDING_LAYER_TYPE = "sliding_attention"
#: Config field holding the window, in tokens.
WINDOW_FIELD = "sliding_window"


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
    return SlidingWindowSpec(sliding_window=window_of(layer), **layer.attention_spec_fields())
