"""What the plugin manager reports about plugins: the loaded ones and those that failed."""

from __future__ import annotations

import attrs

#: Name the core's own families are registered under.
CORE_PLUGIN_NAME = "core"


@attrs.frozen(kw_only=True)
class PluginInfo:
    """A loaded plugin, as ``kvspec plugins`` reports it."""

    name: str
    distribution: str | None
    version: str | None
    spec_kinds: tuple[str, ...]
    hooks: tuple[str, ...]


@attrs.frozen(kw_only=True)
class PluginFailure:
    """A plugin that did not load, and why."""

    name: str
    distribution: str | None
    version: str | None
    error: str
