"""What transformers' model code builds for a config: each decoder layer's cache-holding mixers,
read from the module objects of the model built on the meta device (no weights, no memory).

* a state mixer by its class: Mamba (a ``...Mamba...`` class or any mixer with an
  ``ssm_state_size``), linear attention (gated delta-net, lightning, ``...LinearAttention``),
  short convolution;
* an attention module (a class named ``...Attention``): cross-attention by its name; MLA when
  it has a ``kv_lora_rank``; its window from its own ``sliding_window`` attribute when it has
  one, else from the per-layer cache typing transformers builds its ``DynamicCache`` from
  (``sliding_attention`` with its window, ``chunked_attention`` with its chunk, else full);
* no recognised mixer: a layer that holds no cache (Nemotron-H's MLP / MoE blocks).

An attention module with ``is_kv_shared_layer`` set (Gemma-3n, Gemma-4, Mistral-Large-4)
computes no K/V of its own: its label ends with :data:`READS_SHARED_CACHE`.

:mod:`kvspec_core.models.model_code_check` compares this reading with kvspec's.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from kvspec_core.errors import ConfigError
from kvspec_core.models.layer_type_names import (
    CHUNKED_ATTENTION,
    CROSS_ATTENTION,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    MLA_ATTENTION,
    SLIDING_ATTENTION,
    SLIDING_MLA_ATTENTION,
)

#: A mixer kvspec has no layer type for (LFM2's short convolution).
SHORT_CONV = "short_conv"

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
#: An attention module's K and V projections, as most of transformers' models name them.
_KV_PROJ = ("k_proj", "v_proj")


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
    #: Per decoder layer, the ``(K width, V width)`` of each attention module computing its
    #: own K/V through separate ``k_proj`` / ``v_proj`` projections (their output features:
    #: KV heads x head size), sorted; none for MLA, cross-attention, a layer reading another's
    #: cache, or fused projections (``qkv_proj``), which are not compared.
    kv_widths: tuple[tuple[tuple[int, int], ...], ...] = ()


#: Added to the label of an attention layer that reads another layer's cache (it computes no
#: K/V: transformers' ``is_kv_shared_layer``, kvspec's ``KVSharingSpec``).
READS_SHARED_CACHE = ", reading an earlier layer's cache"


def layer_label(layer_type: str, window: object = None) -> str:
    """A layer type as a reading labels it, with its window when it has one."""
    return layer_type if window is None else f"{layer_type} (window {window})"


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
        return layer_label(SLIDING_MLA_ATTENTION if mla else SLIDING_ATTENTION, window)
    if kind == CHUNKED_ATTENTION:
        return layer_label(CHUNKED_ATTENTION, window)
    return MLA_ATTENTION if mla else FULL_ATTENTION


def _kv_width(module: Any) -> tuple[int, int] | None:
    """``(K, V)`` output widths of an attention module's own ``k_proj`` and ``v_proj``, or
    None where they are not two plain projections of its own K/V (see
    :attr:`ModelCodeReading.kv_widths`)."""
    if (
        "CrossAttention" in type(module).__name__
        or getattr(module, "kv_lora_rank", None) is not None
        or getattr(module, "is_kv_shared_layer", False) is True
    ):
        return None
    k_width, v_width = (
        getattr(getattr(module, name, None), "out_features", None) for name in _KV_PROJ
    )
    if type(k_width) is int and type(v_width) is int and k_width > 0 and v_width > 0:
        return k_width, v_width
    return None


def _attention_modules(module: Any) -> Iterator[Any]:
    """The attention modules under ``module`` (a decoder layer), as :func:`_mixers` finds
    them."""
    for child in module.children():
        if _state_kind(child) is not None:
            continue
        if type(child).__name__.endswith(_ATTENTION_ENDINGS):
            yield child
        else:
            yield from _attention_modules(child)


def _kv_widths(layer: Any) -> tuple[tuple[int, int], ...]:
    found = (_kv_width(module) for module in _attention_modules(layer))
    return tuple(sorted(width for width in found if width is not None))


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


class NotChecked(Exception):
    """The model code cannot be read for this config, for a reason that skips the check."""


def _model_class(text_config: Any) -> Any:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING

    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_MAPPING):
        try:
            return mapping[type(text_config)]
        except KeyError:
            continue
    raise NotChecked(f"transformers has no model class for {type(text_config).__name__}")


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


@functools.lru_cache(maxsize=1)
def rules_digest() -> str:
    """Digest of this module's source: a change to the reading rules invalidates stored readings."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def build_reading(config_json: str, count: int) -> ModelCodeReading:
    """Build the model of ``config_json`` on the meta device and read its ``count`` decoder
    layers; :class:`NotChecked` when transformers has no model class for it."""
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
        kv_widths=tuple(_kv_widths(layer) for layer in layers),
    )
