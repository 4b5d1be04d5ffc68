"""The core's own families, registered through the same hooks as any plugin."""

from __future__ import annotations

from kvspec_core.errors import ConfigError, InvalidFieldError, InvalidFieldTypeError
from kvspec_core.kv_dtypes import BUILTIN_KV_CACHE_DTYPES
from kvspec_core.plugins.contract import CONTRACT_VERSION, hookimpl
from kvspec_core.plugins.core_rules import CORE_RULES
from kvspec_core.plugins.hookspecs import RegisterKVDtype, RegisterRuntimeRules, RegisterSpecKind
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.specs import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVSharingSpec,
    KVSpec,
    SinkFullAttentionSpec,
    UniformTypeSpecs,
)

kvspec_contract_version = CONTRACT_VERSION


@hookimpl
def kvspec_register_spec_kinds(register: RegisterSpecKind) -> None:
    register(FullAttentionSpec)
    register(SinkFullAttentionSpec, uniform_base=FullAttentionSpec)
    register(CrossAttentionSpec)
    register(EncoderOnlyAttentionSpec)
    register(UniformTypeSpecs)
    register(KVSharingSpec)


@hookimpl
def kvspec_register_kv_dtypes(register: RegisterKVDtype) -> None:
    for kv_dtype in BUILTIN_KV_CACHE_DTYPES:
        register(kv_dtype)


@hookimpl
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    for kind, rules in CORE_RULES.items():
        register(kind, rules)


#: Config field declaring how many leading tokens are kept as attention sinks.
SINK_LEN_FIELD = "attention_sink_len"

_CORE_LAYER_TYPES = {
    "full_attention": FullAttentionSpec,
    "cross_attention": CrossAttentionSpec,
    "encoder_only": EncoderOnlyAttentionSpec,
}


@hookimpl
def kvspec_layer_spec(layer: LayerConfig) -> KVSpec | None:
    spec_class = _CORE_LAYER_TYPES.get(layer.layer_type)
    if spec_class is None or layer.attention is None:
        return None
    common = layer.attention_spec_fields()
    sink_len = layer.get(SINK_LEN_FIELD)
    if spec_class is FullAttentionSpec and sink_len is not None:
        try:
            return SinkFullAttentionSpec(sink_len=sink_len, **common)
        except (InvalidFieldError, InvalidFieldTypeError) as error:
            raise ConfigError(
                f"layer {layer.name}: config field {SINK_LEN_FIELD!r}={sink_len!r} is invalid: "
                f"{error.allowed}"
            ) from error
    return spec_class(**common)
