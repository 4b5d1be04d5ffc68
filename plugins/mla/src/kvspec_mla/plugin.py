"""Entry point of kvspec-mla: the hook implementations kvspec-core calls."""

from __future__ import annotations

from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterKVDtype, RegisterSpecKind
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.specs.base import KVSpec
from kvspec_mla.formats import MLA_KV_DTYPES
from kvspec_mla.layers import mla_layer_spec
from kvspec_mla.runtime_rules import kvspec_register_runtime_rules  # noqa: F401  (a hook)
from kvspec_mla.sliding import SlidingWindowMLASpec
from kvspec_mla.specs import CircularBufferSpec, HiddenStateCacheSpec, MLAAttentionSpec

#: The hook contract this plugin was written for (kvspec_core.CONTRACT_VERSION at the time).
kvspec_contract_version = 1


@hookimpl
def kvspec_register_spec_kinds(register: RegisterSpecKind) -> None:
    # MLA pages hold every token like full attention, so MLA layers may share a uniform-type
    # group with full attention (the nearest registered ancestor's base).
    register(MLAAttentionSpec)
    register(HiddenStateCacheSpec)
    # A ring and a window free blocks unlike full attention: each is its own uniform kind.
    register(CircularBufferSpec, uniform_base=CircularBufferSpec)
    register(SlidingWindowMLASpec, uniform_base=SlidingWindowMLASpec)


@hookimpl
def kvspec_register_kv_dtypes(register: RegisterKVDtype) -> None:
    for kv_dtype in MLA_KV_DTYPES:
        register(kv_dtype)


@hookimpl
def kvspec_layer_spec(layer: LayerConfig) -> KVSpec | None:
    return mla_layer_spec(layer)
