"""Plugin machinery: the hook contract (markers, :class:`LayerConfig`, the ``Register*``
callables registration hooks receive), registry, manager, entry-point loading."""

from kvspec_core.plugins.contract import CONTRACT_VERSION, ENTRY_POINT_GROUP, hookimpl, hookspec
from kvspec_core.plugins.hookspecs import RegisterKVDtype, RegisterRuntimeRules, RegisterSpecKind
from kvspec_core.plugins.layer_config import AttentionShape, LayerConfig, PlanOptions
from kvspec_core.plugins.manager import PluginManager, load_plugins
from kvspec_core.plugins.records import PluginFailure, PluginInfo

__all__ = [
    "CONTRACT_VERSION",
    "ENTRY_POINT_GROUP",
    "AttentionShape",
    "LayerConfig",
    "PlanOptions",
    "PluginFailure",
    "PluginInfo",
    "PluginManager",
    "RegisterKVDtype",
    "RegisterRuntimeRules",
    "RegisterSpecKind",
    "hookimpl",
    "hookspec",
    "load_plugins",
]
