"""The core's own families, registered through the same hooks as any plugin."""

from __future__ import annotations

from kvspec_core.kv_dtypes import BUILTIN_KV_CACHE_DTYPES
from kvspec_core.models.layer import LayerConfig
from kvspec_core.plugins.contract import CONTRACT_VERSION, hookimpl
from kvspec_core.plugins.hookspecs import RegisterKVDtype, RegisterRuntimeRules, RegisterSpecKind
from kvspec_core.specs import (
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
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


@hookimpl
def kvspec_register_kv_dtypes(register: RegisterKVDtype) -> None:
    for kv_dtype in BUILTIN_KV_CACHE_DTYPES:
        register(kv_dtype)


@hookimpl
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    from kvspec_core.runtime.rules import CORE_RULES

    for kind, rules in CORE_RULES.items():
        register(kind, rules)


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
    shape = layer.attention
    common = dict(
        block_size=layer.options.block_size,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        head_size_v=shape.head_size_v,
        dtype=shape.dtype,
        kv_quant_mode=shape.kv_quant_mode,
        max_tp_shards=shape.total_kv_heads,
    )
    if spec_class is FullAttentionSpec and layer.get("attention_sink_len") is not None:
        return SinkFullAttentionSpec(sink_len=int(layer.get("attention_sink_len")), **common)
    return spec_class(**common)
