"""Which layers of a model config read another layer's KV cache (cross-layer KV sharing).

Gemma-3n (``model_type`` ``gemma3n_text``, the text config of ``gemma3n``) declares
``num_kv_shared_layers``: its last ``num_kv_shared_layers`` layers compute no K/V and attend
over the K/V of the last layer *of the same attention type* (sliding or full) before them.
This is transformers 5's ``Gemma3nTextConfig.kv_sharing_modes`` (the readers are ``"reuse"``,
each type's last earlier layer ``"store"``) and its ``Gemma3nTextAttention.forward``, which
reads ``shared_kv_states[self.layer_type]`` (written by the ``"store"`` layer of that type);
``tests/models/test_gemma3n_kv_sharing.py`` checks the pairing kvspec reads against the
tensors transformers' own model hands each layer.

A config of another model type that declares sharing (``num_kv_shared_layers`` > 0, or
``kv_source_layers`` naming another layer) is refused naming the field: planning every one of
its layers with a cache of its own would overstate the memory it needs, a plausible wrong
answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvspec_core.errors import ConfigError
from kvspec_core.models.layer_typing import LayerSlot

#: The config field counting the trailing layers that read an earlier layer's cache.
SHARED_LAYERS_FIELD = "num_kv_shared_layers"
#: Mistral-Large-4's per-layer source indices (another model type's sharing declaration).
SOURCE_LAYERS_FIELD = "kv_source_layers"
#: Model types whose last ``num_kv_shared_layers`` layers read the cache of the last earlier
#: layer of their own attention type (transformers' ``Gemma3nTextConfig.kv_sharing_modes``).
TRAILING_LAYERS_SHARE_BY_TYPE = frozenset({"gemma3n_text"})


def _declares_sharing(config: Mapping[str, Any]) -> str | None:
    """The field by which ``config`` declares cross-layer sharing, else ``None``."""
    shared = config.get(SHARED_LAYERS_FIELD)
    if shared not in (None, 0, False):
        return SHARED_LAYERS_FIELD
    sources = config.get(SOURCE_LAYERS_FIELD)
    if isinstance(sources, list) and any(source != index for index, source in enumerate(sources)):
        return SOURCE_LAYERS_FIELD
    return None


def _shared_layer_count(config: Mapping[str, Any], total: int, name: str) -> int:
    value = config.get(SHARED_LAYERS_FIELD, 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < total:
        raise ConfigError(
            f"model {name}: config field {SHARED_LAYERS_FIELD!r} is {value!r}; it must be an "
            f"int from 0 to {total - 1} (how many of the {total} layers, counted from the "
            "last, read an earlier layer's KV cache; at least one layer must hold a cache)"
        )
    return value


def kv_sharing_sources(
    config: Mapping[str, Any],
    slots: Sequence[LayerSlot],
    total_layers: int,
    *,
    name: str = "model",
) -> dict[str, str]:
    """Reader layer name -> the name of the layer whose cache it reads, for the layers
    ``slots`` of ``config`` (``total_layers`` decoder layers); empty when the config declares
    no sharing. Refuses a sharing declaration kvspec cannot read, naming the field."""
    field = _declares_sharing(config)
    if field is None:
        return {}
    model_type = config.get("model_type")
    if model_type not in TRAILING_LAYERS_SHARE_BY_TYPE or field != SHARED_LAYERS_FIELD:
        value = config.get(field)
        raise ConfigError(
            f"model {name} (model_type {model_type!r}) declares cross-layer KV sharing with "
            f"config field {field!r}={value!r:.80}, which kvspec reads only for model types "
            f"{', '.join(sorted(TRAILING_LAYERS_SHARE_BY_TYPE))}; planning each layer a cache "
            "of its own would overstate the memory it needs. Set it to "
            f"{0 if field == SHARED_LAYERS_FIELD else 'each layer its own index'} for that "
            "upper bound, or pass layer specs with KVSharingSpec to the planner"
        )
    shared = _shared_layer_count(config, total_layers, name)
    first_reader = total_layers - shared
    by_index = {slot.index: slot for slot in slots}
    last_of_type: dict[str, LayerSlot] = {}
    for slot in slots:
        if slot.index < first_reader:
            last_of_type[slot.layer_type] = slot
    sources: dict[str, str] = {}
    for index in range(first_reader, total_layers):
        reader = by_index.get(index)
        if reader is None:
            continue  # a layer holding no cache reads none either
        source = last_of_type.get(reader.layer_type)
        if source is None:
            raise ConfigError(
                f"model {name}: layer {reader.name} is one of the last {shared} layers "
                f"({SHARED_LAYERS_FIELD!r}), which read the cache of the last earlier "
                f"{reader.layer_type} layer, but no layer before layer {first_reader} is a "
                f"{reader.layer_type} layer; lower {SHARED_LAYERS_FIELD!r} or fix 'layer_types'"
            )
        sources[reader.name] = source.name
    return sources
