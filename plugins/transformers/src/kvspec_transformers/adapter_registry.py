"""Which layer adapter runs a layer: factories by spec class, and the built-in ones.

The registry sits above every adapter module (:mod:`kvspec_transformers.layer_adapters`,
:mod:`kvspec_transformers.state_layers`), so those never import it. Importing this module
registers the built-in adapters: ``PagedAttentionLayer`` for attention, ``MLALatentLayer``
for MLA and ``StateLayer`` for Mamba-group layers, each plugin's only where it is installed.
"""

from __future__ import annotations

from collections.abc import Callable

from kvspec_core.errors import ConfigError
from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_transformers.layer_adapters import (
    LayerAdapter,
    LayerBinding,
    MLALatentLayer,
    PagedAttentionLayer,
)

AdapterFactory = Callable[[LayerBinding], LayerAdapter]

_ADAPTERS: dict[type[KVSpec], AdapterFactory] = {}


def register_layer_adapter(spec_type: type[KVSpec], factory: AdapterFactory) -> None:
    """Use ``factory`` for layers whose spec is a ``spec_type`` (most derived type wins)."""
    if not (isinstance(spec_type, type) and issubclass(spec_type, KVSpec)):
        raise ConfigError(f"register_layer_adapter: {spec_type!r} is not a KVSpec subclass")
    _ADAPTERS[spec_type] = factory


def adapter_for(binding: LayerBinding) -> LayerAdapter:
    """The adapter of ``binding``: the factory registered for the nearest class in its
    spec's MRO; a clear error names the layer and kind when none is registered."""
    for klass in type(binding.spec).__mro__:
        factory = _ADAPTERS.get(klass)
        if factory is not None:
            return factory(binding)
    raise ConfigError(
        f"layer {binding.layer_name} ({binding.spec.kind}) has no kvspec-transformers layer "
        "adapter; register one with kvspec_transformers.register_layer_adapter"
    )


def _register_builtin_adapters() -> None:
    register_layer_adapter(AttentionSpec, PagedAttentionLayer)
    try:
        from kvspec_mla.specs import MLAAttentionSpec
    except ImportError:  # the MLA plugin is optional
        pass
    else:
        register_layer_adapter(MLAAttentionSpec, MLALatentLayer)
    try:
        from kvspec_mamba.specs import MambaSpec
    except ImportError:  # the Mamba plugin is optional
        return
    from kvspec_transformers.state_layers import StateLayer

    register_layer_adapter(MambaSpec, StateLayer)


_register_builtin_adapters()
