"""Which mixer each decoder layer runs, by model family: attention (its variant decided later,
:mod:`kvspec_core.models.attention_variants`), a state (Mamba, linear attention) or none.

Read from ``layer_types`` when present, else from the family's hybrid pattern field
(Nemotron-H, MiniMax, Bamba, Jamba, Qwen3-Next); see :mod:`kvspec_core.models.layer_typing`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvspec_core.errors import ConfigError
from kvspec_core.models.fields import int_field
from kvspec_core.models.layer_fields import pattern_int, per_layer_list
from kvspec_core.models.layer_type_names import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    SLIDING_ATTENTION,
)

#: ``layer_types`` spellings published configs use for the normalised types.
LAYER_TYPE_ALIASES: Mapping[str, str] = {
    "attention": FULL_ATTENTION,  # Granite-4.0-H
    "global_attention": FULL_ATTENTION,
    "sliding_window_attention": SLIDING_ATTENTION,
    "mamba2": MAMBA,
}

#: model_types whose ``layer_types`` name their Mamba layers ``linear_attention`` (transformers
#: 5's convention, and its Granite-4.0-H default): their model code builds a Mamba-2 mixer there.
MAMBA_NAMED_LINEAR_ATTENTION = frozenset({"granitemoehybrid"})

#: Intermediate marker for "an attention layer whose variant the pattern fields decide".
UNDECIDED_ATTENTION = "attention"

#: Nemotron-H ``hybrid_override_pattern`` characters; ``None`` = no cache (no layer).
HYBRID_PATTERN_CHARS: Mapping[str, str | None] = {
    "M": MAMBA,
    "*": UNDECIDED_ATTENTION,
    "-": None,
    "E": None,
}

#: ``layers_block_type`` entries (the list form of ``hybrid_override_pattern`` vLLM and
#: transformers 5 accept); ``None`` = no cache (no layer). transformers 5 renames the Mamba
#: blocks ``linear_attention`` in this field: its Nemotron-H / Zamba models build a Mamba-2
#: mixer for them, not a linear-attention one.
BLOCK_TYPE_ENTRIES: Mapping[str, str | None] = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": UNDECIDED_ATTENTION,
    "full_attention": UNDECIDED_ATTENTION,
    "mlp": None,
    "moe": None,
}


def _from_layer_types(config: Mapping[str, Any], count: int) -> list[str | None]:
    aliases = LAYER_TYPE_ALIASES
    if config.get("model_type") in MAMBA_NAMED_LINEAR_ATTENTION:
        aliases = {**LAYER_TYPE_ALIASES, LINEAR_ATTENTION: MAMBA}
    types: list[str | None] = []
    for index, value in enumerate(per_layer_list(config, "layer_types", count)):
        if not isinstance(value, str) or not value:
            raise ConfigError(
                f"config field 'layer_types'[{index}] is {value!r}; each entry must be a layer "
                f"type name such as {FULL_ATTENTION!r}"
            )
        types.append(aliases.get(value, value))
    return types


def _from_hybrid_pattern(config: Mapping[str, Any], count: int) -> list[str | None]:
    pattern = per_layer_list(config, "hybrid_override_pattern", count)
    types: list[str | None] = []
    for index, char in enumerate(pattern):
        if char not in HYBRID_PATTERN_CHARS:
            raise ConfigError(
                f"config field 'hybrid_override_pattern' has {char!r} at layer {index}; known "
                f"characters: {', '.join(repr(c) for c in HYBRID_PATTERN_CHARS)}"
            )
        types.append(HYBRID_PATTERN_CHARS[char])
    return types


def _from_block_type_list(config: Mapping[str, Any], count: int) -> list[str | None]:
    types: list[str | None] = []
    for index, entry in enumerate(per_layer_list(config, "layers_block_type", count)):
        if not isinstance(entry, str) or entry not in BLOCK_TYPE_ENTRIES:
            raise ConfigError(
                f"config field 'layers_block_type'[{index}] is {entry!r}, which kvspec does not "
                f"know; known entries: {', '.join(repr(e) for e in BLOCK_TYPE_ENTRIES)}. Fix "
                "the entry, or install a plugin and give 'layer_types' for this model"
            )
        types.append(BLOCK_TYPE_ENTRIES[entry])
    return types


def _describe_block(kind: str | None) -> str:
    return "no cache (MLP / MoE)" if kind is None else kind


def _from_hybrid_forms(config: Mapping[str, Any], count: int) -> list[str | None]:
    """Nemotron-H's pattern string, its list form, or both when they agree layer by layer."""
    has_pattern = config.get("hybrid_override_pattern") is not None
    has_list = config.get("layers_block_type") is not None
    if not has_list:
        return _from_hybrid_pattern(config, count)
    listed = _from_block_type_list(config, count)
    if not has_pattern:
        return listed
    pattern = _from_hybrid_pattern(config, count)
    for index, (from_pattern, from_list) in enumerate(zip(pattern, listed, strict=True)):
        if from_pattern != from_list:
            raise ConfigError(
                f"config fields 'hybrid_override_pattern' and 'layers_block_type' disagree at "
                f"layer {index}: the pattern has {config['hybrid_override_pattern'][index]!r} "
                f"({_describe_block(from_pattern)}), the list "
                f"{config['layers_block_type'][index]!r} "
                f"({_describe_block(from_list)}); keep one of the two fields"
            )
    return listed


def _from_attn_type_list(config: Mapping[str, Any], count: int) -> list[str | None]:
    kinds = {0: LINEAR_ATTENTION, 1: UNDECIDED_ATTENTION}
    types: list[str | None] = []
    for index, value in enumerate(per_layer_list(config, "attn_type_list", count)):
        if isinstance(value, bool) or value not in kinds:
            raise ConfigError(
                f"config field 'attn_type_list'[{index}] is {value!r}; it must be 0 (linear "
                "attention) or 1 (full attention)"
            )
        types.append(kinds[value])
    return types


def _from_attn_layer_indices(config: Mapping[str, Any], count: int) -> list[str | None]:
    """Bamba: attention at the listed layer indices, Mamba everywhere else."""
    # Bamba's model code builds Mamba on every layer when no index is listed.
    indices = config.get("attn_layer_indices")
    if indices is None:
        indices = []
    if not isinstance(indices, list):
        raise ConfigError(
            f"config field 'attn_layer_indices' is {indices!r}; it must be a list of the layer "
            "indices that use attention"
        )
    attention: set[int] = set()
    for position, index in enumerate(indices):
        int_field(
            config,
            f"attn_layer_indices[{position}]",
            index,
            minimum=0,
            maximum=count - 1,
            needed_for="which layers use attention",
        )
        if index in attention:
            raise ConfigError(
                f"config field 'attn_layer_indices' lists layer {index} twice; list each "
                "attention layer once"
            )
        attention.add(index)
    return [UNDECIDED_ATTENTION if i in attention else MAMBA for i in range(count)]


def _from_period(config: Mapping[str, Any], count: int) -> list[str | None]:
    period = pattern_int(config, "attn_layer_period")
    offset = pattern_int(config, "attn_layer_offset", maximum=period - 1)
    return [UNDECIDED_ATTENTION if i % period == offset else MAMBA for i in range(count)]


def _from_full_interval(config: Mapping[str, Any], count: int) -> list[str | None]:
    interval = pattern_int(config, "full_attention_interval")
    return [
        UNDECIDED_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(count)
    ]


def layer_mixers(config: Mapping[str, Any], count: int) -> list[str | None]:
    """Per layer: a final type, :data:`UNDECIDED_ATTENTION` or ``None`` (no cache)."""
    if config.get("layer_types") is not None:
        return _from_layer_types(config, count)
    if (
        config.get("hybrid_override_pattern") is not None
        or config.get("layers_block_type") is not None
    ):
        return _from_hybrid_forms(config, count)
    if config.get("attn_type_list") is not None:
        return _from_attn_type_list(config, count)
    if config.get("attn_layer_indices") is not None or config.get("model_type") == "bamba":
        return _from_attn_layer_indices(config, count)
    if config.get("attn_layer_period") is not None:
        return _from_period(config, count)
    if config.get("full_attention_interval") is not None:
        return _from_full_interval(config, count)
    return [UNDECIDED_ATTENTION] * count
