"""Entry point of kvspec-chunked-local: the hook implementations kvspec-core calls."""

from __future__ import annotations

from kvspec_chunked_local.layers import chunked_local_spec
from kvspec_chunked_local.runtime_rules import kvspec_register_runtime_rules  # noqa: F401  (pluggy finds hookimpls by module attribute)
from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec
from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterSpecKind
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.specs.base import KVSpec

#: The hook contract this plugin was written for (kvspec_core.CONTRACT_VERSION at the time).
kvspec_contract_version = 1


@hookimpl
def kvspec_register_spec_kinds(register: RegisterSpecKind) -> None:
    register(ChunkedLocalAttentionSpec)


@hookimpl
def kvspec_layer_spec(layer: LayerConfig) -> KVSpec | None:
    return chunked_local_spec(layer)
