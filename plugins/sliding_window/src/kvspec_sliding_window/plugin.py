"""Entry point of kvspec-sliding-window: the hook implementations kvspec-core calls."""

from __future__ import annotations

from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterSpecKind
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.specs.base import KVSpec
from kvspec_sliding_window.layers import sliding_window_spec
from kvspec_sliding_window.runtime_rules import kvspec_register_runtime_rules  # noqa: F401  (pluggy finds hookimpls by module attribute)
from kvspec_sliding_window.specs import (
    KpoolTailSpec,
    ReferenceSlidingWindowSpec,
    SlidingWindowSpec,
)

#: The hook contract this plugin was written for (kvspec_core.CONTRACT_VERSION at the time).
kvspec_contract_version = 1


@hookimpl
def kvspec_register_spec_kinds(register: RegisterSpecKind) -> None:
    register(SlidingWindowSpec)
    # Each is its own uniform-type kind: a one-block tail and R-SWA's prefix-plus-window
    # never free blocks like a plain window (or full attention) does.
    register(KpoolTailSpec, uniform_base=KpoolTailSpec)
    register(ReferenceSlidingWindowSpec, uniform_base=ReferenceSlidingWindowSpec)


@hookimpl
def kvspec_layer_spec(layer: LayerConfig) -> KVSpec | None:
    return sliding_window_spec(layer)
