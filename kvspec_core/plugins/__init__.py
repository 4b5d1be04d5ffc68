"""Plugin machinery: hook contract, registry, manager, entry-point loading."""

from kvspec_core.plugins.contract import CONTRACT_VERSION, ENTRY_POINT_GROUP, hookimpl, hookspec
from kvspec_core.plugins.manager import PluginFailure, PluginInfo, PluginManager

__all__ = [
    "CONTRACT_VERSION",
    "ENTRY_POINT_GROUP",
    "PluginFailure",
    "PluginInfo",
    "PluginManager",
    "hookimpl",
    "hookspec",
]
