"""Model config -> one :class:`LayerConfig` per layer -> one spec per layer, via the plugins.

Public API::

    model = model_layers(config_dict, PlanOptions(...), manager, name="llama-3.1-8b")
    specs = layer_specs(model, manager)          # {layer name: KVSpec}, in layer order
    ctx = default_sizing_context(model)          # SizingContext with the config's defaults

The core types every layer (:mod:`kvspec_core.models.layer_typing`) and resolves its attention
geometry on one TP rank (:mod:`kvspec_core.models.attention_shape`); each plugin's
``kvspec_layer_spec`` hook then claims the layers of its family. Exactly one claim per layer.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs
import torch

from kvspec_core.context import SizingContext
from kvspec_core.errors import ConfigError, MissingFamilyError, PluginError
from kvspec_core.kv_dtypes import KVCacheDtype
from kvspec_core.models.attention_shape import check_given_head_fields, resolve_attention_shape
from kvspec_core.models.encoder_decoder import (
    decoder_max_len,
    encoder_decoder_slots,
    encoder_max_len,
    is_encoder_decoder,
)
from kvspec_core.models.fields import MissingConfigFieldError, optional_int
from kvspec_core.models.head_fields import HeadFields
from kvspec_core.models.kv_sharing import kv_sharing_sources
from kvspec_core.models.layer_typing import (
    ATTENTION_LAYER_TYPES,
    NORMALISED_LAYER_TYPES,
    STATE_LAYER_TYPES,
    LayerSlot,
    decoder_layer_slots,
    num_layers,
)
from kvspec_core.models.model_code_check import (
    check_against_model_code,
    check_kv_widths_against_model_code,
)
from kvspec_core.models.normalized import ModelConfig, normalize_config, with_defaults_hint
from kvspec_core.plugins.known_families import LAYER_TYPE_DISTRIBUTIONS, install_hint
from kvspec_core.plugins.layer_config import AttentionShape, LayerConfig, PlanOptions
from kvspec_core.specs.kv_sharing import KVSharingSpec

if TYPE_CHECKING:
    from kvspec_core.plugins.manager import PluginManager
    from kvspec_core.specs.base import KVSpec

#: In-flight token budget when the caller gives none (an engine's default batched tokens).
DEFAULT_MAX_IN_FLIGHT_TOKENS = 16384
#: Layer types served by the core itself (no plugin needed).
CORE_LAYER_TYPES = frozenset({"full_attention", "cross_attention", "encoder_only"})


@attrs.frozen(kw_only=True, eq=False)
class ModelLayers:
    """A model config typed into layers, ready for the plugins.

    Attributes:
        name: the model's name in reports (preset name or config path).
        config: the effective (language-model) config plugins read, defaults filled.
        source: the config read once (:class:`~kvspec_core.models.normalized.ModelConfig`):
            where its defaults came from, its dtype.
        layers: one :class:`LayerConfig` per cache-holding layer, in model order.
        default_max_model_len: the config's longest sequence (``max_position_embeddings``;
            Whisper: ``max_target_positions``), or ``None`` when it declares none.
        max_encoder_tokens: encoder tokens cross-attention layers hold (0 without encoder).
        options: the planning options the layers were resolved with.
        kv_sharing: reader layer name -> the layer whose KV cache it reads (cross-layer KV
            sharing, :mod:`kvspec_core.models.kv_sharing`); :func:`layer_specs` gives each
            reader a :class:`~kvspec_core.specs.kv_sharing.KVSharingSpec`.
    """

    name: str
    config: Mapping[str, Any]
    source: ModelConfig
    layers: tuple[LayerConfig, ...]
    default_max_model_len: int | None
    max_encoder_tokens: int
    options: PlanOptions
    kv_sharing: Mapping[str, str] = attrs.field(factory=dict)

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Distinct layer types, in first-seen order."""
        return tuple(dict.fromkeys(layer.layer_type for layer in self.layers))

    @property
    def has_state_layers(self) -> bool:
        """Whether any layer keeps a recurrent state (Mamba / linear attention)."""
        return any(layer.layer_type in STATE_LAYER_TYPES for layer in self.layers)


def _layer_slots(config: Mapping[str, Any]) -> list[LayerSlot]:
    if is_encoder_decoder(config):
        return encoder_decoder_slots(config)
    return decoder_layer_slots(config)


def _attention_shape(
    slot: LayerSlot,
    config: Mapping[str, Any],
    options: PlanOptions,
    kv_dtype: KVCacheDtype,
    dtype: torch.dtype,
) -> AttentionShape | None:
    known = slot.layer_type in NORMALISED_LAYER_TYPES
    if known and slot.layer_type not in ATTENTION_LAYER_TYPES:
        return None  # Mamba / linear attention: their plugin reads the state fields.
    try:
        return resolve_attention_shape(
            config,
            slot.layer_type,
            fields=slot.head_fields,
            tensor_parallel_size=options.tensor_parallel_size,
            decode_context_parallel_size=options.decode_context_parallel_size,
            kv_dtype=kv_dtype,
            kv_cache_dtype=options.kv_cache_dtype,
            model_dtype=dtype,
            where=f"layer {slot.name} ({slot.layer_type})",
        )
    except ConfigError:
        if known:
            raise
        # A third-party type may not be attention at all; its plugin reads its own fields.
        return None


def model_layers(
    config: Mapping[str, Any] | ModelConfig,
    options: PlanOptions,
    manager: PluginManager,
    *,
    name: str = "model",
) -> ModelLayers:
    """Type every layer of ``config`` (a parsed ``config.json``, or one already read by
    :func:`~kvspec_core.models.normalized.normalize_config`) and resolve its geometry under
    ``options``; refuses bad fields naming them, and an unknown KV dtype listing the known
    ones (from ``manager.kv_dtypes``)."""
    kv_dtype = manager.kv_dtypes.get(options.kv_cache_dtype)
    source = normalize_config(config)
    try:
        return _typed_layers(source, options, kv_dtype, name)
    except MissingConfigFieldError as error:
        raise with_defaults_hint(error, source) from None


def _typed_layers(
    source: ModelConfig, options: PlanOptions, kv_dtype: KVCacheDtype, name: str
) -> ModelLayers:
    text = source.fields
    # The shape depends on the layer's type and head fields only: resolved once for each,
    # not for each of (up to MAX_LAYERS) layers.
    shapes: dict[tuple[str, HeadFields], AttentionShape | None] = {}
    layers = []
    slots = _layer_slots(text)
    encoder_decoder = is_encoder_decoder(text)
    sharing = (
        {} if encoder_decoder else kv_sharing_sources(text, slots, num_layers(text), name=name)
    )
    readers = {slot.index for slot in slots if slot.name in sharing}
    reading = None
    if source.transformers_filled and not encoder_decoder:
        # A head field given but unusable is named before transformers builds the model
        # from it (found by review: num_key_value_heads -8 or 0 gave transformers' own
        # RuntimeError / ZeroDivisionError, and a fix that would not help).
        check_given_head_fields(text)
        reading = check_against_model_code(
            source.raw, text, slots, num_layers(text), name=name, readers=readers
        )
    for slot in slots:
        key = (slot.layer_type, slot.head_fields)
        if key not in shapes:
            shapes[key] = _attention_shape(slot, text, options, kv_dtype, source.dtype)
        layers.append(
            LayerConfig(
                index=slot.index,
                name=slot.name,
                layer_type=slot.layer_type,
                config=text,
                options=options,
                model_dtype=source.dtype,
                attention=shapes[key],
            )
        )
    if not layers:
        raise ConfigError(
            f"model {name} has no layer that holds a KV cache (every layer of its pattern is "
            "MLP-only); check 'num_hidden_layers' and the layer pattern fields"
        )
    check_kv_widths_against_model_code(reading, layers, name=name, readers=readers)
    max_len = decoder_max_len(text) if encoder_decoder else declared_length(text)
    return ModelLayers(
        name=name,
        config=text,
        source=source,
        layers=tuple(layers),
        default_max_model_len=max_len,
        max_encoder_tokens=(encoder_max_len(text) or 0) if encoder_decoder else 0,
        options=options,
        kv_sharing=sharing,
    )


def _missing_family(layer: LayerConfig, unclaimed: Counter[str]) -> MissingFamilyError:
    more = unclaimed[layer.layer_type] - 1
    others = f" (and {more} more layers of that type)" if more else ""
    distribution = LAYER_TYPE_DISTRIBUTIONS.get(layer.layer_type)
    if distribution is not None:
        fix = (
            f"it is provided by {distribution}: {install_hint(distribution)} (if it is "
            "installed, `kvspec plugins` shows whether it failed to load or KVSPEC_PLUGINS "
            "excludes it)"
        )
    else:
        fix = (
            "install the plugin that provides this layer type (`kvspec plugins` lists loaded ones)"
        )
    return MissingFamilyError(
        f"layer {layer.name}{others} has layer type {layer.layer_type!r}, which no loaded "
        f"plugin claims; {fix}"
    )


def layer_specs(model: ModelLayers, manager: PluginManager) -> dict[str, KVSpec]:
    """One spec per layer, in layer order, each claimed by exactly one plugin."""
    specs: dict[str, KVSpec] = {}
    unclaimed: list[LayerConfig] = []
    for layer in model.layers:
        try:
            claims = manager.layer_specs(layer)
        except MissingConfigFieldError as error:
            raise with_defaults_hint(error, model.source) from None
        if len(claims) > 1:
            owners = ", ".join(f"{plugin!r} ({spec.kind})" for plugin, spec in claims)
            raise PluginError(
                f"layer {layer.name} ({layer.layer_type}) is claimed by several plugins: "
                f"{owners}; exactly one may claim a layer. Uninstall one of them, or restrict "
                "loading with KVSPEC_PLUGINS"
            )
        if not claims:
            unclaimed.append(layer)
            continue
        spec = claims[0][1]
        source = model.kv_sharing.get(layer.name)
        # The family's spec describes the cache the layer reads; it holds none itself.
        specs[layer.name] = (
            spec if source is None else KVSharingSpec(target_layer=source, reader_spec=spec)
        )
    if unclaimed:
        raise _missing_family(unclaimed[0], Counter(layer.layer_type for layer in unclaimed))
    return specs


#: Config fields naming a model's longest sequence, as vLLM reads them
#: (``derive_max_model_len_and_key``): the smallest of those present, unless
#: ``model_max_length`` (Command-R) names one.
LENGTH_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)


def declared_length(config: Mapping[str, Any]) -> int | None:
    """The longest sequence a decoder-only config declares, as vLLM derives it (found by
    review: GLM's ``seq_length``, MPT's ``max_seq_len`` and Command-R's ``model_max_length``
    were not read); None when it names none."""
    # Every field present is checked, model_max_length among them (read once).
    lengths = {
        name: optional_int(config, name, needed_for="the default max model length")
        for name in LENGTH_FIELDS
    }
    override = lengths["model_max_length"]
    if override is not None:
        return override
    return min((length for length in lengths.values() if length is not None), default=None)


def default_sizing_context(
    model: ModelLayers,
    *,
    max_model_len: int | None = None,
    max_in_flight_tokens: int = DEFAULT_MAX_IN_FLIGHT_TOKENS,
    prefix_caching: bool = True,
) -> SizingContext:
    """The :class:`SizingContext` a plan of ``model`` uses: ``max_model_len`` defaults to the
    config's; Mamba cache mode ``align`` (checkpoints kept for prefix caching) when the model
    has Mamba / linear-attention layers and prefix caching is on; DCP from the options."""
    length = max_model_len if max_model_len is not None else model.default_max_model_len
    if length is None:
        raise ConfigError(
            f"model {model.name} declares no length ({', '.join(LENGTH_FIELDS)}); pass the "
            "max model length explicitly (--max-model-len)"
        )
    mode = "align" if model.has_state_layers and prefix_caching else "none"
    return SizingContext(
        max_model_len=length,
        max_in_flight_tokens=max_in_flight_tokens,
        dcp_size=model.options.decode_context_parallel_size,
        mamba_cache_mode=mode,
        max_encoder_tokens=model.max_encoder_tokens,
        prefix_caching=prefix_caching,
    )
