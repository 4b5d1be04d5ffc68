"""kvspec's layer typing checked against the model code transformers runs for the config.

kvspec types layers from config fields (:mod:`kvspec_core.models.layer_typing`). A field it
does not read but the model code honours (Bamba's ``attn_layer_indices`` before it was read;
Nemotron-H's ``layers_block_type`` list) gives a plausible, wrong plan. So where transformers
knows the config's ``model_type``, the model is built on the meta device (no weights, no
memory) and each decoder layer's mixer is read from the module objects:

* a state mixer by its class: Mamba (a ``...Mamba...`` class or any mixer with an
  ``ssm_state_size``), linear attention (gated delta-net, lightning, ``...LinearAttention``),
  short convolution;
* an attention module (a class named ``...Attention``): cross-attention by its name; MLA when
  it has a ``kv_lora_rank``; its window from its own ``sliding_window`` attribute when it has
  one, else from the per-layer cache typing transformers builds its ``DynamicCache`` from
  (``sliding_attention`` with its window, ``chunked_attention`` with its chunk, else full);
* no recognised mixer: a layer that holds no cache (Nemotron-H's MLP / MoE blocks).

An attention module with ``is_kv_shared_layer`` set computes no K/V and attends over an
earlier layer's (Gemma-3n, Gemma-4, Mistral-Large-4): its label says so, and must match the
layers kvspec reads as cross-layer KV sharing (:mod:`kvspec_core.models.kv_sharing`).

kvspec's reading (each layer's normalised types; the window of sliding layers from
``sliding_window``, the chunk of chunked layers from ``attention_chunk_size``, the fields
those families size from) must equal the model code's, layer by layer, else
:func:`check_against_model_code` refuses, naming both readings and the first layer that
differs.

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
import hashlib
import json
import os
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvspec_core.errors import ConfigError
from kvspec_core.models.layer_typing import (
    CHUNKED_ATTENTION,
    CROSS_ATTENTION,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    MLA_ATTENTION,
    NORMALISED_LAYER_TYPES,
    SLIDING_ATTENTION,
    SLIDING_MLA_ATTENTION,
    LayerSlot,
)
from kvspec_core.models.model_code_cache import entry_key, load_entry, store_entry

#: Environment variable that turns the check off (``off``) when a model cannot be read.
CHECK_SWITCH_VARIABLE = "KVSPEC_MODEL_CODE_CHECK"
#: A mixer kvspec has no layer type for (LFM2's short convolution).
SHORT_CONV = "short_conv"
#: Deepest config checked: 8x the deepest published model (Llama-3.1-405B, 126 layers).
MAX_CHECKED_LAYERS = 1024
#: Readings kept (one per distinct config planned in this process).
_CACHED_READINGS = 64

#: A recurrent block kvspec has no layer type for (RecurrentGemma's RG-LRU).
RECURRENT_BLOCK = "recurrent_block"

#: Class-name fragments of state mixers other than Mamba, checked before the attention rule
#: (MiniMax's lightning attention and Kimi's delta attention are recurrent states). Mamba
#: mixers are told by their ``ssm_state_size`` instead: Bamba's and Falcon-H1's carry no
#: "Mamba" in their class name, and Mamba's RMSNorm does.
_STATE_MIXER_NAMES = (
    ("GatedDeltaNet", LINEAR_ATTENTION),
    ("DeltaAttention", LINEAR_ATTENTION),
    ("LightningAttention", LINEAR_ATTENTION),
    ("ShortConv", SHORT_CONV),
    ("RecurrentBlock", RECURRENT_BLOCK),
)
#: Names transformers' models give their decoder layer lists.
_LAYER_LIST_NAMES = frozenset({"layers", "h", "blocks", "layer", "decoder_layers"})
#: Class-name endings of attention modules (LongCat-Flash names its MLA modules ``...MLA``).
_ATTENTION_ENDINGS = ("Attention", "MLA")
#: Layer types of windowed attention, and the config field kvspec sizes the window from.
_WINDOW_FIELDS = {
    SLIDING_ATTENTION: "sliding_window",
    SLIDING_MLA_ATTENTION: "sliding_window",
    CHUNKED_ATTENTION: "attention_chunk_size",
}


@attrs.frozen(kw_only=True)
class ModelCodeReading:
    """What transformers' model code builds for a config.

    Attributes:
        model_class: the class built (e.g. ``NemotronHForCausalLM``).
        layers: per decoder layer, the sorted labels of its cache-holding mixers (empty for
            a layer holding none), e.g. ``("sliding_attention (window 4096)",)``.
        modules: per decoder layer, the class names of its direct children (for messages).
    """

    model_class: str
    layers: tuple[tuple[str, ...], ...]
    modules: tuple[tuple[str, ...], ...]


#: Added to the label of an attention layer that reads another layer's cache (it computes no
#: K/V: transformers' ``is_kv_shared_layer``, kvspec's ``KVSharingSpec``).
READS_SHARED_CACHE = ", reading an earlier layer's cache"


def _label(layer_type: str, window: object = None) -> str:
    return layer_type if window is None else f"{layer_type} (window {window})"


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
        label = _label(slot.layer_type, fields.get(field) if field else None)
        here.append(label + (READS_SHARED_CACHE if slot.index in readers else ""))
    return [None if layer is None else tuple(sorted(layer)) for layer in labels]


def _state_kind(module: Any) -> str | None:
    if hasattr(module, "ssm_state_size"):
        return MAMBA
    name = type(module).__name__
    for fragment, kind in _STATE_MIXER_NAMES:
        if fragment in name:
            return kind
    return None


def _attention_label(module: Any, cache_type: tuple[str, Any], local_window: Any) -> str:
    label = _attention_kind_label(module, cache_type, local_window)
    # Gemma-3n, Gemma-4 and Mistral-Large-4 mark a layer computing no K/V of its own.
    if getattr(module, "is_kv_shared_layer", False) is True:
        return label + READS_SHARED_CACHE
    return label


def _attention_kind_label(module: Any, cache_type: tuple[str, Any], local_window: Any) -> str:
    name = type(module).__name__
    if "CrossAttention" in name:
        return CROSS_ATTENTION
    mla = getattr(module, "kv_lora_rank", None) is not None
    # What the module's forward passes to the attention kernel: ``is_sliding`` switches a
    # window held on every layer (EXAONE-4, Gemma-3), else ``sliding_window`` is set only on
    # sliding layers (Gemma-2, Qwen2, GPT-OSS); without either the config decides, as
    # transformers types its own cache layers (Mistral, Phi-3, Llama-4's chunks).
    is_sliding = getattr(module, "is_sliding", None)
    window = getattr(module, "sliding_window", None)
    if getattr(module, "attention_type", None) == "local":  # GPT-Neo's local layers
        kind, window = SLIDING_ATTENTION, local_window
    elif isinstance(is_sliding, bool):
        kind = SLIDING_ATTENTION if is_sliding else FULL_ATTENTION
        if window is None:
            window = cache_type[1]
    elif hasattr(module, "sliding_window"):
        kind = SLIDING_ATTENTION if window is not None else FULL_ATTENTION
    else:
        kind, window = cache_type
    if kind == SLIDING_ATTENTION:
        return _label(SLIDING_MLA_ATTENTION if mla else SLIDING_ATTENTION, window)
    if kind == CHUNKED_ATTENTION:
        return _label(CHUNKED_ATTENTION, window)
    return MLA_ATTENTION if mla else FULL_ATTENTION


def _mixers(module: Any, cache_type: tuple[str, Any], local_window: Any) -> Iterator[str]:
    """Labels of the cache-holding mixers under ``module`` (a decoder layer); a classified
    mixer's own children are not searched."""
    for child in module.children():
        state = _state_kind(child)
        if state is not None:
            yield state
        elif type(child).__name__.endswith(_ATTENTION_ENDINGS):
            yield _attention_label(child, cache_type, local_window)
        else:
            yield from _mixers(child, cache_type, local_window)


def _cache_types(text_config: Any, count: int) -> list[tuple[str, Any]]:
    """Per layer, (type, window) as transformers types its ``DynamicCache`` layers."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    layer_types, kwargs = get_layer_types_and_kwargs(text_config)
    # Paired as DynamicCache pairs them (transformers zips the two lists, so does this).
    types = [
        (str(kind), extra.get("sliding_window"))
        for kind, extra in zip(layer_types, kwargs, strict=False)
    ]
    return types + [(FULL_ATTENTION, None)] * (count - len(types))


class _NotChecked(Exception):
    """The model code cannot be read for this config, for a reason that skips the check."""


def _model_class(text_config: Any) -> Any:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING):
        try:
            return mapping[type(text_config)]
        except KeyError:
            continue
    raise _NotChecked(f"transformers has no model class for {type(text_config).__name__}")


def _decoder_layers(model: Any, count: int) -> Sequence[Any]:
    """The model's decoder layer list: a module list of ``count`` entries, by preference one
    named as decoder stacks are (``model.layers``, GPT-2's ``transformer.h``), not a list of
    experts that happens to have as many entries."""
    import torch

    lists = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList)
    ]
    fitting = [(name, layers) for name, layers in lists if len(layers) == count]
    fitting.sort(key=lambda item: item[0].rsplit(".", 1)[-1] not in _LAYER_LIST_NAMES)
    if fitting:
        return list(fitting[0][1])
    found = (
        ", ".join(
            f"{name} ({len(layers)})"
            for name, layers in lists
            if name.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES
        )
        or "none"
    )
    raise ConfigError(
        f"the config declares {count} decoder layers but transformers' {type(model).__name__} "
        f"built no layer list of that length (layer lists: {found}); check "
        f"'num_hidden_layers' and the layer pattern fields"
    )


def _labels(value: object, count: int) -> tuple[tuple[str, ...], ...] | None:
    """``value`` (a stored entry's field) as ``count`` tuples of strings, else ``None``."""
    if not isinstance(value, list) or len(value) != count:
        return None
    if not all(
        isinstance(layer, list) and all(isinstance(x, str) for x in layer) for layer in value
    ):
        return None
    return tuple(tuple(layer) for layer in value)


def _stored_reading(entry: Mapping[str, Any] | None, count: int) -> ModelCodeReading | None:
    """The reading an on-disk entry holds, or ``None`` when it has not the expected shape."""
    if entry is None or not isinstance(entry.get("model_class"), str):
        return None
    layers = _labels(entry.get("layers"), count)
    modules = _labels(entry.get("modules"), count)
    if layers is None or modules is None:
        return None
    return ModelCodeReading(model_class=entry["model_class"], layers=layers, modules=modules)


@functools.lru_cache(maxsize=1)
def _rules_digest() -> str:
    """Digest of this module's source: a change to the reading rules invalidates stored readings."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


@functools.lru_cache(maxsize=_CACHED_READINGS)
def _read_model_code(config_json: str, count: int) -> ModelCodeReading:
    """The reading of ``config_json``: from memory, else from disk, else built."""
    key = entry_key(config_json, count, _rules_digest())
    stored = _stored_reading(load_entry(key), count)
    if stored is not None:
        return stored
    reading = _build_reading(config_json, count)
    store_entry(key, attrs.asdict(reading))
    return reading


def _build_reading(config_json: str, count: int) -> ModelCodeReading:
    import torch
    from transformers import CONFIG_MAPPING

    from kvspec_core.models.normalized import quiet_transformers

    raw = json.loads(config_json)
    with quiet_transformers():
        config = CONFIG_MAPPING[raw["model_type"]].from_dict(raw)
        text_config = config.get_text_config(decoder=True)
        model_class = _model_class(text_config)
        with torch.device("meta"):
            model = model_class._from_config(text_config)
    layers = _decoder_layers(model, count)
    cache_types = _cache_types(text_config, count)
    return ModelCodeReading(
        model_class=model_class.__name__,
        layers=tuple(
            tuple(sorted(_mixers(layer, cache_types[i], getattr(text_config, "window_size", None))))
            for i, layer in enumerate(layers)
        ),
        modules=tuple(
            tuple(type(child).__name__ for child in layer.children()) for layer in layers
        ),
    )


def _switched_off() -> bool:
    value = os.environ.get(CHECK_SWITCH_VARIABLE, "on")
    if value not in ("on", "off"):
        raise ConfigError(
            f"{CHECK_SWITCH_VARIABLE}={value!r}; it must be 'on' (the default: check kvspec's "
            "layer typing against transformers' model code) or 'off'"
        )
    return value == "off"


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
    except (_NotChecked, ImportError):
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
) -> None:
    """Refuse when kvspec's typing of the decoder-only config ``raw`` (``slots`` over
    ``count`` layers, ``fields`` as filled, ``readers`` the indices of layers reading another
    layer's cache) disagrees with transformers' model code."""
    reading = model_code_reading(raw, count)
    if reading is None:
        return
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
