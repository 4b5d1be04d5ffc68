"""A model ``config.json`` parsed once into the config kvspec plans from, defaults filled.

Published configs leave out fields whose value lives in the model's Hugging Face config class
(Gemma-3's ``text_config`` carries no head counts; Granite-4.0-H no ``mamba_expand``); engines
load them through transformers and get those defaults. So does kvspec, when the optional extra
``kvspec-core[hf]`` is installed: the config's ``model_type`` picks transformers' own config
class (``CONFIG_MAPPING``), built offline from the dict, and every field the file leaves out
(or sets to ``null``) takes the value that class gives it. Values the file states always win.

Without transformers, a complete config plans the same; the few defaults in
:data:`kvspec_core.models.defaults.PUBLISHED_DEFAULTS` are still applied, and a field that
only transformers could fill is refused naming the field and the extra
(:func:`with_defaults_hint`). A ``model_type`` transformers does not know keeps the file's
fields as they are.

Multimodal configs nest their language model in ``text_config`` (Gemma-3, Llama-4): that is
the config the layers are read from, with the outer dtype when the inner one names none.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch

from kvspec_core.errors import ConfigError
from kvspec_core.models.defaults import with_published_defaults
from kvspec_core.models.fields import (
    DTYPE_FIELDS,
    MAX_LAYERS,
    MissingConfigFieldError,
    first_present,
    is_int,
    model_dtype,
)
from kvspec_core.models.layer_typing import check_pattern_fields
from kvspec_core.models.rope_and_type_fields import check_model_type_and_rope
from kvspec_core.validation import MAX_FIELD_VALUE

#: Where multimodal configs nest their language model.
TEXT_CONFIG_FIELD = "text_config"
#: The extra that brings transformers (and huggingface_hub).
HF_EXTRA_INSTALL = "pip install 'kvspec-core[hf]'"

#: Where the defaults of a :class:`ModelConfig` came from.
DEFAULTS_FROM_TRANSFORMERS = "transformers"
DEFAULTS_FROM_KVSPEC = "kvspec"

#: Fields transformers' config classes expand into per-layer lists; a hostile count must be
#: refused by kvspec's own checks before transformers builds a list that long.
_LAYER_COUNT_FIELDS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
)
#: Deepest nesting walked when checking a config before handing it to transformers.
_MAX_CHECK_DEPTH = 8


@attrs.frozen(kw_only=True, eq=False)
class ModelConfig:
    """A model config read once: the language model's fields with defaults filled.

    Attributes:
        model_type: the language model's ``model_type`` (``None`` when the config has none).
        fields: the fields layers and plugins read (``text_config`` when nested), defaults
            filled; read-only.
        raw: the config as parsed from ``config.json``; read-only.
        dtype: the model's dtype (``torch_dtype`` / ``dtype``, inner then outer config;
            bfloat16 when neither names one).
        dtype_field: the field that named the dtype, or ``None`` when defaulted.
        defaults_from: ``"transformers"`` when its config class filled the defaults, else
            ``"kvspec"`` (only the published-defaults table).
        filled_fields: fields the file leaves out (or nulls) that the defaults filled.
        defaults_note: why transformers did not fill the defaults (not installed, unknown
            ``model_type``, refused the config), or ``None`` when it did.
    """

    model_type: str | None
    fields: Mapping[str, Any]
    raw: Mapping[str, Any]
    dtype: torch.dtype
    dtype_field: str | None
    defaults_from: str
    filled_fields: tuple[str, ...]
    defaults_note: str | None

    @property
    def transformers_filled(self) -> bool:
        """Whether transformers' config class supplied the defaults."""
        return self.defaults_from == DEFAULTS_FROM_TRANSFORMERS


class _TransformersUnavailable(Exception):
    """transformers cannot fill this config's defaults; the message says why."""


def _import_transformers_configs() -> Mapping[str, Any]:
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        raise _TransformersUnavailable(
            f"transformers is not installed ({HF_EXTRA_INSTALL} adds it)"
        ) from None
    return CONFIG_MAPPING


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' log lines and warnings while a config class is built: the CLI's
    output is the plan, and transformers' advice is about loading weights."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)


def _too_large_for_transformers(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` holds a layer count or size kvspec's own checks refuse: transformers
    would expand it (a per-layer list of 10**12 entries) before any check."""
    if depth > _MAX_CHECK_DEPTH:
        return True
    if isinstance(value, Mapping):
        for key, item in value.items():
            if key in _LAYER_COUNT_FIELDS and is_int(item) and not 0 <= item <= MAX_LAYERS:
                return True
            if _too_large_for_transformers(item, depth + 1):
                return True
        return False
    if isinstance(value, list):
        return any(_too_large_for_transformers(item, depth + 1) for item in value)
    return is_int(value) and abs(value) > MAX_FIELD_VALUE


def _transformers_fields(raw: Mapping[str, Any], nested: bool) -> dict[str, Any]:
    """The (text) config as transformers' config class for ``raw['model_type']`` fills it."""
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise _TransformersUnavailable("the config names no 'model_type'")
    mapping = _import_transformers_configs()
    if model_type not in mapping:
        raise _TransformersUnavailable(f"transformers does not know model_type {model_type!r}")
    if _too_large_for_transformers(raw):
        raise _TransformersUnavailable("the config holds sizes beyond kvspec's limits")
    config_class = mapping[model_type]
    try:
        with quiet_transformers():
            built = config_class.from_dict(dict(raw))
            if nested:
                built = getattr(built, TEXT_CONFIG_FIELD)
            filled = built.to_dict()
    except Exception as error:  # any refusal by transformers: keep the file's own fields
        raise _TransformersUnavailable(
            f"transformers' {config_class.__name__} refused the config: "
            f"{type(error).__name__}: {error}"
        ) from None
    if not isinstance(filled, dict):
        raise _TransformersUnavailable(f"{config_class.__name__}.to_dict() gave no dict")
    return filled


def _with_outer_dtype(inner: Mapping[str, Any], outer: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(inner)
    if first_present(merged, *DTYPE_FIELDS) is None:
        found = first_present(outer, *DTYPE_FIELDS)
        if found is not None:
            merged[found[0]] = found[1]
    return merged


def _language_fields(raw: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The language model's fields as the file states them, and whether they were nested."""
    inner = raw.get(TEXT_CONFIG_FIELD)
    if inner is None:
        return dict(raw), False
    if not isinstance(inner, dict):
        raise ConfigError(
            f"config field {TEXT_CONFIG_FIELD!r} is a {type(inner).__name__}; it must be an "
            "object holding the language model's config"
        )
    return _with_outer_dtype(inner, raw), True


def _fill(stated: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``defaults`` overlaid by every value ``stated`` sets (not ``null``)."""
    filled = dict(defaults)
    filled.update({key: value for key, value in stated.items() if value is not None})
    return filled


def normalize_config(config: Mapping[str, Any] | ModelConfig) -> ModelConfig:
    """``config`` (a parsed ``config.json``) read once into a :class:`ModelConfig`; a
    :class:`ModelConfig` is returned unchanged."""
    if isinstance(config, ModelConfig):
        return config
    if not isinstance(config, Mapping):
        raise ConfigError(f"a model config is a JSON object, not a {type(config).__name__}")
    raw = dict(config)
    stated, nested = _language_fields(raw)
    # Before transformers derives ``layer_types`` from them (see check_pattern_fields).
    check_pattern_fields(stated)
    check_model_type_and_rope(raw)
    if nested:
        check_model_type_and_rope(stated, f"{TEXT_CONFIG_FIELD}.")
    note: str | None = None
    try:
        fields = _fill(stated, _transformers_fields(raw, nested))
        source = DEFAULTS_FROM_TRANSFORMERS
    except _TransformersUnavailable as reason:
        fields, source, note = dict(stated), DEFAULTS_FROM_KVSPEC, str(reason)
    fields = with_published_defaults(fields)
    found = first_present(fields, *DTYPE_FIELDS)
    model_type = fields.get("model_type")
    return ModelConfig(
        model_type=model_type if isinstance(model_type, str) else None,
        fields=MappingProxyType(fields),
        raw=MappingProxyType(raw),
        dtype=model_dtype(fields),
        dtype_field=found[0] if found is not None and found[1] != "auto" else None,
        defaults_from=source,
        filled_fields=tuple(sorted(k for k in fields if stated.get(k) is None)),
        defaults_note=note,
    )


def with_defaults_hint(error: MissingConfigFieldError, config: ModelConfig) -> ConfigError:
    """``error`` (a field the config lacks) with how to get its default: install
    transformers when it is missing, else say why it could not fill it."""
    if config.transformers_filled or config.defaults_note is None:
        return error
    kind = f"model_type {config.model_type!r}" if config.model_type else "this model"
    if "not installed" in config.defaults_note:
        fix = (
            f"kvspec takes its default from transformers' config class for {kind}, and "
            f"transformers is not installed: run `{HF_EXTRA_INSTALL}`"
        )
    else:
        fix = f"kvspec could not take its default from transformers ({config.defaults_note})"
    return MissingConfigFieldError(f"{error}; {fix}", fields=error.fields)
