"""kvspec's layer typing checked against the model code transformers runs for the config.

kvspec types layers from config fields (:mod:`kvspec_core.models.layer_typing`). A field it
does not read but the model code honours (Bamba's ``attn_layer_indices`` before it was read;
Nemotron-H's ``layers_block_type`` list) gives a plausible, wrong plan. So where transformers
knows the config's ``model_type``, the model is built on the meta device (no weights, no
memory) and each decoder layer's mixer is read from the module objects (the rules:
:mod:`kvspec_core.models.model_code_reader`).

An attention module with ``is_kv_shared_layer`` set computes no K/V and attends over an
earlier layer's (Gemma-3n, Gemma-4, Mistral-Large-4): its label says so, and must match the
layers kvspec reads as cross-layer KV sharing (:mod:`kvspec_core.models.kv_sharing`).

kvspec's reading (each layer's normalised types; the window of sliding layers from
``sliding_window``, the chunk of chunked layers from ``attention_chunk_size``, the fields
those families size from) must equal the model code's, layer by layer, else
:func:`check_against_model_code` refuses, naming both readings and the first layer that
differs. Once the head fields are resolved, each layer's K/V widths (KV heads x head size)
must equal its ``k_proj`` / ``v_proj`` output widths where the model code has them, else
:func:`check_kv_widths_against_model_code` refuses.

When it does not run (the plan is made from the config alone, as before): transformers is not
installed, does not know the ``model_type`` or its config class refused the config (see
:mod:`kvspec_core.models.normalized`); transformers has no model class for the type; the
config is an encoder-decoder one; it declares more than :data:`MAX_CHECKED_LAYERS` layers
(no published model comes near; building one takes seconds per thousand layers, and kvspec
accepts up to 10,000 for stress tests); ``KVSPEC_MODEL_CODE_CHECK=off``. Layers of a type only a
third-party plugin knows are not compared (that plugin reads its own fields).

When it refuses: a disagreement; and a model it cannot read (building it fails, or no decoder
layer list of the config's length). A mixer class it does not recognise reads as "no cache",
so a layer kvspec plans a cache for is refused naming the layer's module classes rather than
passed: an unreadable model is an error that says how to skip the check, never a silent pass.
Readings are cached per config in memory and on disk
(:mod:`kvspec_core.models.model_code_cache`), so planning a config again costs no second
build, nor, in a new process, the import of transformers' modeling code.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from kvspec_core.errors import ConfigError
from kvspec_core.models.layer_typing import (
    CHUNKED_ATTENTION,
    CROSS_ATTENTION,
    MLA_ATTENTION,
    NORMALISED_LAYER_TYPES,
    SLIDING_ATTENTION,
    SLIDING_MLA_ATTENTION,
    LayerSlot,
)
from kvspec_core.models.model_code_cache import entry_key, load_entry, store_entry
from kvspec_core.models.model_code_reader import (
    READS_SHARED_CACHE,
    RECURRENT_BLOCK,
    SHORT_CONV,
    ModelCodeReading,
    NotChecked,
    build_reading,
    layer_label,
    rules_digest,
)
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.switches import switch_value

__all__ = [
    "CHECK_SWITCH_VARIABLE",
    "MAX_CHECKED_LAYERS",
    "READS_SHARED_CACHE",
    "RECURRENT_BLOCK",
    "SHORT_CONV",
    "ModelCodeReading",
    "check_against_model_code",
    "check_kv_widths_against_model_code",
    "kvspec_labels",
    "model_code_reading",
]

#: Environment variable that turns the check off (``off``) when a model cannot be read.
CHECK_SWITCH_VARIABLE = "KVSPEC_MODEL_CODE_CHECK"
#: Deepest config checked: 8x the deepest published model (Llama-3.1-405B, 126 layers).
MAX_CHECKED_LAYERS = 1024
#: Readings kept (one per distinct config planned in this process).
_CACHED_READINGS = 64

#: Layer types whose K/V widths are not compared (an MLA latent is no K/V head; a cross
#: attention's K/V come from the encoder).
_UNCOMPARED_WIDTHS = frozenset({MLA_ATTENTION, SLIDING_MLA_ATTENTION, CROSS_ATTENTION})

#: Layer types of windowed attention, and the config field kvspec sizes the window from.
_WINDOW_FIELDS = {
    SLIDING_ATTENTION: "sliding_window",
    SLIDING_MLA_ATTENTION: "sliding_window",
    CHUNKED_ATTENTION: "attention_chunk_size",
}


def kvspec_labels(
    slots: Sequence[LayerSlot],
    fields: Mapping[str, Any],
    count: int,
    readers: Collection[int] = (),
) -> list[tuple[str, ...] | None]:
    """kvspec's reading per decoder layer, as :class:`ModelCodeReading` labels; ``None`` for
    a layer holding a type only a third-party plugin knows (not compared). ``readers`` are
    the indices of layers that read another layer's cache (cross-layer KV sharing)."""
    labels: list[list[str] | None] = [[] for _ in range(count)]
    for slot in slots:
        here = labels[slot.index]
        if here is None:
            continue
        if slot.layer_type not in NORMALISED_LAYER_TYPES:
            labels[slot.index] = None
            continue
        field = _WINDOW_FIELDS.get(slot.layer_type)
        label = layer_label(slot.layer_type, fields.get(field) if field else None)
        here.append(label + (READS_SHARED_CACHE if slot.index in readers else ""))
    return [None if layer is None else tuple(sorted(layer)) for layer in labels]


def _labels(value: object, count: int) -> tuple[tuple[str, ...], ...] | None:
    """``value`` (a stored entry's field) as ``count`` tuples of strings, else ``None``."""
    if not isinstance(value, list) or len(value) != count:
        return None
    if not all(
        isinstance(layer, list) and all(isinstance(x, str) for x in layer) for layer in value
    ):
        return None
    return tuple(tuple(layer) for layer in value)


def _widths(value: object, count: int) -> tuple[tuple[tuple[int, int], ...], ...] | None:
    """``value`` (a stored entry's ``kv_widths``) as ``count`` tuples of int pairs, else
    ``None``."""
    if not isinstance(value, list) or len(value) != count:
        return None
    layers = []
    for layer in value:
        if not isinstance(layer, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)
            for pair in layer
        ):
            return None
        layers.append(tuple((pair[0], pair[1]) for pair in layer))
    return tuple(layers)


def _stored_reading(entry: Mapping[str, Any] | None, count: int) -> ModelCodeReading | None:
    """The reading an on-disk entry holds, or ``None`` when it has not the expected shape."""
    if entry is None or not isinstance(entry.get("model_class"), str):
        return None
    layers = _labels(entry.get("layers"), count)
    modules = _labels(entry.get("modules"), count)
    kv_widths = _widths(entry.get("kv_widths"), count)
    if layers is None or modules is None or kv_widths is None:
        return None
    return ModelCodeReading(
        model_class=entry["model_class"], layers=layers, modules=modules, kv_widths=kv_widths
    )


@functools.lru_cache(maxsize=_CACHED_READINGS)
def _read_model_code(config_json: str, count: int) -> ModelCodeReading:
    """The reading of ``config_json``: from memory, else from disk, else built."""
    key = entry_key(config_json, count, rules_digest())
    stored = _stored_reading(load_entry(key), count)
    if stored is not None:
        return stored
    reading = build_reading(config_json, count)
    store_entry(key, attrs.asdict(reading))
    return reading


def _switched_off() -> bool:
    raw = os.environ.get(CHECK_SWITCH_VARIABLE)
    if raw is None or not raw.strip():
        return False  # the default: checked
    # The words every kvspec switch takes (KVSPEC_STRICT_PLUGINS too).
    value = switch_value(raw)
    if value is None:
        raise ConfigError(
            f"{CHECK_SWITCH_VARIABLE}={raw!r}; it must be 'on' (the default: check kvspec's "
            "layer typing against transformers' model code) or 'off' (also 1/true/yes, "
            "0/false/no)"
        )
    return not value


def model_code_reading(raw: Mapping[str, Any], count: int) -> ModelCodeReading | None:
    """transformers' reading of the config ``raw`` with ``count`` decoder layers, or
    ``None`` when the check is skipped (no model class for the type, deeper than
    :data:`MAX_CHECKED_LAYERS`, switched off). A model that transformers knows but cannot
    build is refused, saying how to skip the check."""
    if _switched_off() or count > MAX_CHECKED_LAYERS:
        return None
    config_json = json.dumps(dict(raw), sort_keys=True, default=repr)
    try:
        return _read_model_code(config_json, count)
    except (NotChecked, ImportError):
        return None
    except ConfigError:
        raise
    except Exception as error:  # any failure of transformers' model code
        raise ConfigError(
            f"kvspec checks its layer typing against the model transformers builds for "
            f"model_type {raw.get('model_type')!r}, and building it failed "
            f"({type(error).__name__}: {error}); fix the config, or plan from the config "
            f"alone with {CHECK_SWITCH_VARIABLE}=off"
        ) from None


def _summary(labels: Sequence[tuple[str, ...] | None]) -> str:
    counts = Counter(" + ".join(layer) or "no cache" for layer in labels if layer is not None)
    return ", ".join(f"{count} x {kind}" for kind, count in counts.items())


def check_against_model_code(
    raw: Mapping[str, Any],
    fields: Mapping[str, Any],
    slots: Sequence[LayerSlot],
    count: int,
    *,
    name: str,
    readers: Collection[int] = (),
) -> ModelCodeReading | None:
    """Refuse when kvspec's typing of the decoder-only config ``raw`` (``slots`` over
    ``count`` layers, ``fields`` as filled, ``readers`` the indices of layers reading another
    layer's cache) disagrees with transformers' model code; the reading compared (``None``:
    not checked), for :func:`check_kv_widths_against_model_code`."""
    reading = model_code_reading(raw, count)
    if reading is None:
        return None
    ours = kvspec_labels(slots, fields, count, readers)
    for index, (kvspec_layer, code_layer) in enumerate(zip(ours, reading.layers, strict=True)):
        if kvspec_layer is None or kvspec_layer == code_layer:
            continue
        modules = ", ".join(reading.modules[index])
        raise ConfigError(
            f"model {name}: kvspec's layer typing disagrees with transformers' "
            f"{reading.model_class} at layer {index}: kvspec reads "
            f"{' + '.join(kvspec_layer) or 'no cache'}, the model code builds "
            f"{' + '.join(code_layer) or 'no cache-holding mixer'} (its modules: {modules}). "
            f"kvspec reads {_summary(ours)}; the model code {_summary(reading.layers)}. A "
            "config field decides the layer kinds differently for the two: fix the layer "
            "pattern fields (layer_types, sliding_window, num_kv_shared_layers, ...) so both "
            "agree, or plan from the "
            f"config alone with {CHECK_SWITCH_VARIABLE}=off"
        )
    return reading


def check_kv_widths_against_model_code(
    reading: ModelCodeReading | None,
    layers: Sequence[LayerConfig],
    *,
    name: str,
    readers: Collection[int] = (),
) -> None:
    """Refuse when the K/V widths kvspec reads from the head fields (KV heads x head size,
    all ranks together) differ from those of the model code's ``k_proj`` / ``v_proj``, layer
    by layer, where the model code has them (:attr:`ModelCodeReading.kv_widths`): a head
    field kvspec reads otherwise than the model (Falcon's ``multi_query``, Gemma-4's
    ``global_head_dim``, ...) gives a plausible, wrong size. ``reading``: what
    :func:`check_against_model_code` compared (``None``: not checked)."""
    if reading is None or not reading.kv_widths:
        return
    for layer in layers:
        shape = layer.attention
        if shape is None or layer.index in readers or layer.layer_type in _UNCOMPARED_WIDTHS:
            continue
        code = reading.kv_widths[layer.index]
        if len(code) != 1:
            continue  # none to compare, or several attention modules in one layer
        ours = (shape.total_kv_heads * shape.head_size, shape.total_kv_heads * shape.head_size_v)
        if ours == code[0]:
            continue
        raise ConfigError(
            f"model {name}: layer {layer.name} ({layer.layer_type}): kvspec reads K/V widths "
            f"of {ours[0]} / {ours[1]} ({shape.total_kv_heads} KV heads x head size "
            f"{shape.head_size}), but transformers' {reading.model_class} projects "
            f"{code[0][0]} / {code[0][1]} (k_proj / v_proj): the config's head fields are read "
            "otherwise by the model code, and the KV cache would be sized wrong. Fix the head "
            "fields (num_key_value_heads, head_dim, ...) so both agree, or plan from the "
            f"config alone with {CHECK_SWITCH_VARIABLE}=off"
        )
