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

The rules live beside this module: :mod:`~kvspec_core.models.layer_type_names` (the normalised
types), :mod:`~kvspec_core.models.layer_fields` (the layer count, per-layer lists, pattern
fields), :mod:`~kvspec_core.models.layer_mixers` (attention vs. state per model family, 1-2)
and :mod:`~kvspec_core.models.attention_variants` (3-4). Their public names are importable
from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvspec_core.errors import ConfigError
from kvspec_core.models.attention_variants import attention_variants, with_mla
from kvspec_core.models.head_fields import DECODER_ONLY_FIELDS, HeadFields
from kvspec_core.models.layer_fields import PATTERN_INT_FIELDS, check_pattern_fields, num_layers
from kvspec_core.models.layer_mixers import (
    BLOCK_TYPE_ENTRIES,
    HYBRID_PATTERN_CHARS,
    LAYER_TYPE_ALIASES,
    MAMBA_NAMED_LINEAR_ATTENTION,
    UNDECIDED_ATTENTION,
    layer_mixers,
)
from kvspec_core.models.layer_type_names import (
    ATTENTION_LAYER_TYPES,
    CHUNKED_ATTENTION,
    CROSS_ATTENTION,
    ENCODER_ONLY,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    MLA_ATTENTION,
    NORMALISED_LAYER_TYPES,
    SLIDING_ATTENTION,
    SLIDING_MLA_ATTENTION,
    STATE_LAYER_TYPES,
)

__all__ = [
    "ATTENTION_LAYER_TYPES",
    "BLOCK_TYPE_ENTRIES",
    "CHUNKED_ATTENTION",
    "CROSS_ATTENTION",
    "ENCODER_ONLY",
    "FULL_ATTENTION",
    "HYBRID_PATTERN_CHARS",
    "LAYER_TYPE_ALIASES",
    "LINEAR_ATTENTION",
    "MAMBA",
    "MAMBA_NAMED_LINEAR_ATTENTION",
    "MLA_ATTENTION",
    "NORMALISED_LAYER_TYPES",
    "PARALLEL_STATE_MIXERS",
    "PATTERN_INT_FIELDS",
    "SLIDING_ATTENTION",
    "SLIDING_MLA_ATTENTION",
    "STATE_LAYER_TYPES",
    "STATE_SPACE_ONLY_MODEL_TYPES",
    "LayerSlot",
    "check_pattern_fields",
    "decoder_layer_slots",
    "decoder_layer_types",
    "num_layers",
]

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

#: model_type -> the state mixer each decoder layer runs in parallel with its attention (the
#: published modeling code builds both in every layer; the config has no field saying so).
PARALLEL_STATE_MIXERS: Mapping[str, str] = {"falcon_h1": MAMBA}


@attrs.frozen(kw_only=True)
class LayerSlot:
    """One cache-holding layer: its index in the model, plan name, normalised type, and
    the config fields holding its head geometry."""

    index: int
    name: str
    layer_type: str
    head_fields: HeadFields = DECODER_ONLY_FIELDS


def decoder_layer_types(config: Mapping[str, Any]) -> list[str | None]:
    """Normalised type of every decoder layer; ``None`` for layers that hold no cache."""
    model_type = config.get("model_type")
    if model_type in STATE_SPACE_ONLY_MODEL_TYPES:
        raise ConfigError(
            f"model_type {model_type!r} has no attention layers (every layer is a recurrent "
            "state-space block); kvspec does not plan it: its layers would read as attention"
        )
    count = num_layers(config)
    mixers = layer_mixers(config, count)
    if UNDECIDED_ATTENTION in mixers:
        variants = attention_variants(config, count)
        mixers = [
            variants[i] if kind == UNDECIDED_ATTENTION else kind for i, kind in enumerate(mixers)
        ]
    if config.get("kv_lora_rank") is not None:
        mixers = [with_mla(kind) if kind is not None else None for kind in mixers]
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
