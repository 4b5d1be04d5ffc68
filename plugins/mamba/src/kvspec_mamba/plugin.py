"""Entry point of kvspec-mamba: the hook implementations kvspec-core calls."""

from __future__ import annotations

from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterSpecKind
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.specs.base import KVSpec
from kvspec_mamba.layers import mamba_spec
from kvspec_mamba.runtime_rules import kvspec_register_runtime_rules  # noqa: F401  (pluggy finds hookimpls by module attribute)
from kvspec_mamba.specs import MambaSpec

#: The hook contract this plugin was written for (kvspec_core.CONTRACT_VERSION at the time).
kvspec_contract_version = 1


@hookimpl
def kvspec_register_spec_kinds(register: RegisterSpecKind) -> None:
    register(MambaSpec)


@hookimpl
def kvspec_layer_spec(layer: LayerConfig) -> KVSpec | None:
    return mamba_spec(layer)
