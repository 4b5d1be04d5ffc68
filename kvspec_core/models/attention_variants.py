"""Which attention variant each attention layer is: full, sliding or chunked, from the pattern
fields (``attention_chunk_size`` with Llama-4's NoPE layers, ``sliding_window`` with its
pattern fields), made MLA by ``kv_lora_rank``; see :mod:`kvspec_core.models.layer_typing`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvspec_core.errors import ConfigError
from kvspec_core.models.defaults import DEFAULT_NO_ROPE_LAYER_INTERVAL
from kvspec_core.models.fields import first_present
from kvspec_core.models.layer_fields import pattern_int, per_layer_list, sliding_switch
from kvspec_core.models.layer_type_names import (
    CHUNKED_ATTENTION,
    FULL_ATTENTION,
    MLA_ATTENTION,
    SLIDING_ATTENTION,
    SLIDING_MLA_ATTENTION,
)


def _global_chunk_layers(config: Mapping[str, Any], count: int) -> set[int]:
    """Layers of a chunked-attention model that attend globally (Llama-4's NoPE layers)."""
    if config.get("no_rope_layers") is not None:
        flags = per_layer_list(config, "no_rope_layers", count)
        if any(flag not in (0, 1) or isinstance(flag, bool) for flag in flags):
            raise ConfigError(
                "config field 'no_rope_layers' must hold 0 (global NoPE layer) or 1 (chunked "
                "RoPE layer) per layer"
            )
        return {i for i, flag in enumerate(flags) if flag == 0}
    interval = DEFAULT_NO_ROPE_LAYER_INTERVAL
    if config.get("no_rope_layer_interval") is not None:
        interval = pattern_int(config, "no_rope_layer_interval")
    return {i for i in range(count) if (i + 1) % interval == 0}


def _sliding_layers(config: Mapping[str, Any], count: int) -> set[int]:
    """Layers that slide, from the pattern fields (no ``layer_types``)."""
    switch = sliding_switch(config)
    if config.get("sliding_window") is None or switch is False:
        return set()
    if first_present(config, "sliding_window_pattern", "_sliding_window_pattern") is not None:
        pattern = pattern_int(config, "sliding_window_pattern", "_sliding_window_pattern")
        return {i for i in range(count) if (i + 1) % pattern}
    if switch is True and config.get("max_window_layers") is not None:
        first = pattern_int(config, "max_window_layers")
        return set(range(first, count))
    return set(range(count))


def attention_variants(config: Mapping[str, Any], count: int) -> list[str]:
    """Full / sliding / chunked for every layer index, from the pattern fields."""
    if config.get("attention_chunk_size") is not None:
        global_layers = _global_chunk_layers(config, count)
        return [FULL_ATTENTION if i in global_layers else CHUNKED_ATTENTION for i in range(count)]
    sliding = _sliding_layers(config, count)
    return [SLIDING_ATTENTION if i in sliding else FULL_ATTENTION for i in range(count)]


def with_mla(layer_type: str) -> str:
    """The MLA form of a full or sliding attention type; other types unchanged."""
    return {FULL_ATTENTION: MLA_ATTENTION, SLIDING_ATTENTION: SLIDING_MLA_ATTENTION}.get(
        layer_type, layer_type
    )
