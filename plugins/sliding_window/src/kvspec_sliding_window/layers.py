"""Turning a ``sliding_attention`` model layer into a :class:`SlidingWindowSpec`."""

from __future__ import annotations

from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_sliding_window.specs import SlidingWindowSpec

#: The normalised layer type this family claims.
SLIDING_LAYER_TYPE = "sliding_attention"
#: Config field holding the window, in tokens.
WINDOW_FIELD = "sliding_window"


def window_of(layer: LayerConfig) -> int:
    """The layer's window from the config's ``sliding_window``; refused unless a positive int."""
    return layer.positive_int(
        WINDOW_FIELD,
        "tokens each query attends to",
        f"Set {WINDOW_FIELD!r} in the config, or type the layer as full attention",
    )


def sliding_window_spec(layer: LayerConfig) -> SlidingWindowSpec | None:
    """The spec of ``layer`` if it is a sliding-window layer, else ``None``."""
    if layer.layer_type != SLIDING_LAYER_TYPE:
        return None
    return SlidingWindowSpec(sliding_window=window_of(layer), **layer.attention_spec_fields())
