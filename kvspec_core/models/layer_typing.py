"""Which kind of cache each layer of a decoder-only model needs: the core's layer typing.

The core only *normalises* a config into one layer type per layer; the plugin that claims a
type reads its own fields (``sliding_window``, ``attention_chunk_size``, ``kv_lora_rank``,
Mamba state fields...). Sources, in priority order:

1. ``layer_types`` (newer configs): each value normalised (``attention`` -> ``full_attention``);
   values the core does not know pass through unchanged for third-party plugins.
2. Hybrid patterns deciding attention vs. state layers:
   ``hybrid_override_pattern`` (Nemotron-H: ``M`` Mamba, ``*`` attention, ``-``/``E``
   MLP or MoE only: no cache, no layer) or its list form ``layers_block_type`` (``mamba``,
   ``attention``, ``mlp``, ``moe``; transformers 5 writes ``linear_attention`` for the Mamba
   blocks and ``full_attention`` for attention), both forms refused when they disagree,
   ``attn_type_list`` (MiniMax: 0 linear, 1 full),
   ``attn_layer_indices`` (Bamba: the rest are Mamba; none listed: all Mamba),
   ``attn_layer_period`` + ``attn_layer_offset`` (Jamba: the rest are Mamba),
   ``full_attention_interval`` (Qwen3-Next: the rest are linear attention).
3. For attention layers not typed by ``layer_types``: ``attention_chunk_size`` (chunked,
   except the global NoPE layers given by ``no_rope_layers`` or ``no_rope_layer_interval``);
   ``sliding_window`` unless ``use_sliding_window`` is false, on layers chosen by
   ``sliding_window_pattern`` (layer i slides when ``(i + 1) % pattern``: Gemma-2/3, Cohere2),
   by ``max_window_layers`` when ``use_sliding_window`` is true (Qwen2: layers from there
   on slide), else on every layer (Mistral, Phi-3).
4. ``kv_lora_rank`` makes attention layers MLA (``mla_attention``, or
   ``sliding_mla_attention`` for sliding ones).

Parallel hybrids (Falcon-H1) run a Mamba mixer beside attention in every layer: each such
layer yields two cache-holding layers, ``model.layers.<i>.self_attn`` and
``model.layers.<i>.mamba``; see :data:`PARALLEL_STATE_MIXERS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvspec_core.errors import ConfigError
from kvspec_core.models.defaults import DEFAULT_NO_ROPE_LAYER_INTERVAL
from kvspec_core.models.fields import (
    MAX_LAYERS,
    first_present,
    int_field,
    missing_field,
    optional_int,
    require_int,
)
from kvspec_core.models.head_fields import DECODER_ONLY_FIELDS, HeadFields
from kvspec_core.validation import MAX_FIELD_VALUE

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
CHUNKED_ATTENTION = "chunked_attention"
MLA_ATTENTION = "mla_attention"
SLIDING_MLA_ATTENTION = "sliding_mla_attention"
LINEAR_ATTENTION = "linear_attention"
MAMBA = "mamba"
CROSS_ATTENTION = "cross_attention"
ENCODER_ONLY = "encoder_only"

#: Every layer type the core normalises to.
NORMALISED_LAYER_TYPES = (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    CHUNKED_ATTENTION,
    MLA_ATTENTION,
    SLIDING_MLA_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    CROSS_ATTENTION,
    ENCODER_ONLY,
)
#: Layer types whose cache is a fixed-size recurrent state rather than per-token K/V.
STATE_LAYER_TYPES = frozenset({MAMBA, LINEAR_ATTENTION})
#: Layer types whose geometry is attention heads (the core resolves an AttentionShape).
ATTENTION_LAYER_TYPES = frozenset(
    {
        FULL_ATTENTION,
        SLIDING_ATTENTION,
        CHUNKED_ATTENTION,
        MLA_ATTENTION,
        SLIDING_MLA_ATTENTION,
        CROSS_ATTENTION,
        ENCODER_ONLY,
    }
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

#: model_types whose every layer is a recurrent block kvspec has no layer typing for (their
#: configs carry no pattern field, so they would otherwise read as full attention).
STATE_SPACE_ONLY_MODEL_TYPES = frozenset(
    {
        "mamba",
        "mamba2",
        "falcon_mamba",
        "rwkv",
        "xlstm",
        "recurrent_gemma",
    }
)

#: Nemotron-H ``hybrid_override_pattern`` characters; ``None`` = no cache (no layer).
HYBRID_PATTERN_CHARS: Mapping[str, str | None] = {
    "M": MAMBA,
    "*": "attention",
    "-": None,
    "E": None,
}

#: model_type -> the state mixer each decoder layer runs in parallel with its attention (the
#: published modeling code builds both in every layer; the config has no field saying so).
PARALLEL_STATE_MIXERS: Mapping[str, str] = {"falcon_h1": MAMBA}

# Intermediate marker for "an attention layer whose variant the pattern fields decide".
_ATTENTION = "attention"

#: ``layers_block_type`` entries (the list form of ``hybrid_override_pattern`` vLLM and
#: transformers 5 accept); ``None`` = no cache (no layer). transformers 5 renames the Mamba
#: blocks ``linear_attention`` in this field: its Nemotron-H / Zamba models build a Mamba-2
#: mixer for them, not a linear-attention one.
BLOCK_TYPE_ENTRIES: Mapping[str, str | None] = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": _ATTENTION,
    "full_attention": _ATTENTION,
    "mlp": None,
    "moe": None,
}


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


@attrs.frozen(kw_only=True)
class LayerSlot:
    """One cache-holding layer: its index in the model, plan name, normalised type, and
    the config fields holding its head geometry."""

    index: int
    name: str
    layer_type: str
    head_fields: HeadFields = DECODER_ONLY_FIELDS


def num_layers(config: Mapping[str, Any]) -> int:
    """Decoder layer count: ``num_hidden_layers`` (or ``n_layer``/``num_layers``), else the
    length of ``layer_types`` (or ``layers_block_type`` / ``hybrid_override_pattern``, which
    transformers 5 counts Nemotron-H's layers from); bounded by :data:`MAX_LAYERS`."""
    declared = optional_int(
        config,
        "num_hidden_layers",
        "n_layer",
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


def _per_layer_list(config: Mapping[str, Any], field: str, count: int) -> Sequence[Any]:
    values = config[field]
    if not isinstance(values, (list, str)) or len(values) != count:
        length = len(values) if isinstance(values, (list, str)) else "not a list"
        raise ConfigError(
            f"config field {field!r} must give one entry per layer: num_hidden_layers is "
            f"{count} but {field!r} has {length}; fix {field!r} or 'num_hidden_layers'"
        )
    return values


def _from_layer_types(config: Mapping[str, Any], count: int) -> list[str | None]:
    aliases = LAYER_TYPE_ALIASES
    if config.get("model_type") in MAMBA_NAMED_LINEAR_ATTENTION:
        aliases = {**LAYER_TYPE_ALIASES, LINEAR_ATTENTION: MAMBA}
    types: list[str | None] = []
    for index, value in enumerate(_per_layer_list(config, "layer_types", count)):
        if not isinstance(value, str) or not value:
            raise ConfigError(
                f"config field 'layer_types'[{index}] is {value!r}; each entry must be a layer "
                f"type name such as {FULL_ATTENTION!r}"
            )
        types.append(aliases.get(value, value))
    return types


def _from_hybrid_pattern(config: Mapping[str, Any], count: int) -> list[str | None]:
    pattern = _per_layer_list(config, "hybrid_override_pattern", count)
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
    for index, entry in enumerate(_per_layer_list(config, "layers_block_type", count)):
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
    kinds = {0: LINEAR_ATTENTION, 1: _ATTENTION}
    types: list[str | None] = []
    for index, value in enumerate(_per_layer_list(config, "attn_type_list", count)):
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
    return [_ATTENTION if i in attention else MAMBA for i in range(count)]


def _pattern_int(config: Mapping[str, Any], *fields: str, maximum: int | None = None) -> int:
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


def _sliding_switch(config: Mapping[str, Any]) -> bool | None:
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
            _pattern_int(config, field)
    _sliding_switch(config)


def _from_period(config: Mapping[str, Any], count: int) -> list[str | None]:
    period = _pattern_int(config, "attn_layer_period")
    offset = _pattern_int(config, "attn_layer_offset", maximum=period - 1)
    return [_ATTENTION if i % period == offset else MAMBA for i in range(count)]


def _from_full_interval(config: Mapping[str, Any], count: int) -> list[str | None]:
    interval = _pattern_int(config, "full_attention_interval")
    return [_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(count)]


def _mixers(config: Mapping[str, Any], count: int) -> list[str | None]:
    """Per layer: a final type, ``_ATTENTION`` (variant still open) or ``None`` (no cache)."""
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
    return [_ATTENTION] * count


def _global_chunk_layers(config: Mapping[str, Any], count: int) -> set[int]:
    """Layers of a chunked-attention model that attend globally (Llama-4's NoPE layers)."""
    if config.get("no_rope_layers") is not None:
        flags = _per_layer_list(config, "no_rope_layers", count)
        if any(flag not in (0, 1) or isinstance(flag, bool) for flag in flags):
            raise ConfigError(
                "config field 'no_rope_layers' must hold 0 (global NoPE layer) or 1 (chunked "
                "RoPE layer) per layer"
            )
        return {i for i, flag in enumerate(flags) if flag == 0}
    interval = DEFAULT_NO_ROPE_LAYER_INTERVAL
    if config.get("no_rope_layer_interval") is not None:
        interval = _pattern_int(config, "no_rope_layer_interval")
    return {i for i in range(count) if (i + 1) % interval == 0}


def _sliding_layers(config: Mapping[str, Any], count: int) -> set[int]:
    """Layers that slide, from the pattern fields (no ``layer_types``)."""
    switch = _sliding_switch(config)
    if config.get("sliding_window") is None or switch is False:
        return set()
    if first_present(config, "sliding_window_pattern", "_sliding_window_pattern") is not None:
        pattern = _pattern_int(config, "sliding_window_pattern", "_sliding_window_pattern")
        return {i for i in range(count) if (i + 1) % pattern}
    if switch is True and config.get("max_window_layers") is not None:
        first = _pattern_int(config, "max_window_layers")
        return set(range(first, count))
    return set(range(count))


def _attention_variants(config: Mapping[str, Any], count: int) -> list[str]:
    """Full / sliding / chunked for every layer index, from the pattern fields."""
    if config.get("attention_chunk_size") is not None:
        global_layers = _global_chunk_layers(config, count)
        return [FULL_ATTENTION if i in global_layers else CHUNKED_ATTENTION for i in range(count)]
    sliding = _sliding_layers(config, count)
    return [SLIDING_ATTENTION if i in sliding else FULL_ATTENTION for i in range(count)]


def _with_mla(layer_type: str) -> str:
    return {FULL_ATTENTION: MLA_ATTENTION, SLIDING_ATTENTION: SLIDING_MLA_ATTENTION}.get(
        layer_type, layer_type
    )


def decoder_layer_types(config: Mapping[str, Any]) -> list[str | None]:
    """Normalised type of every decoder layer; ``None`` for layers that hold no cache."""
    model_type = config.get("model_type")
    if model_type in STATE_SPACE_ONLY_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} has no attention layers (every layer is a recurrent "
            "state-space block); kvspec does not plan it: its layers would read as attention"
        )
    count = num_layers(config)
    mixers = _mixers(config, count)
    if _ATTENTION in mixers:
        variants = _attention_variants(config, count)
        mixers = [variants[i] if kind == _ATTENTION else kind for i, kind in enumerate(mixers)]
    if config.get("kv_lora_rank") is not None:
        mixers = [_with_mla(kind) if kind is not None else None for kind in mixers]
    return mixers


def decoder_layer_slots(config: Mapping[str, Any]) -> list[LayerSlot]:
    """One :class:`LayerSlot` per cache-holding decoder layer (``model.layers.<i>``); two per
    layer of a parallel hybrid (``model.layers.<i>.self_attn`` and ``.mamba``)."""
    types = decoder_layer_types(config)
    parallel = PARALLEL_STATE_MIXERS.get(str(config.get("model_type", "")))
    if parallel is None:
        return [
            LayerSlot(index=i, name=f"model.layers.{i}", layer_type=kind)
            for i, kind in enumerate(types)
            if kind is not None
        ]
    slots: list[LayerSlot] = []
    for i, kind in enumerate(types):
        if kind is None:
            continue
        slots.append(LayerSlot(index=i, name=f"model.layers.{i}.self_attn", layer_type=kind))
        slots.append(LayerSlot(index=i, name=f"model.layers.{i}.{parallel}", layer_type=parallel))
    return slots
