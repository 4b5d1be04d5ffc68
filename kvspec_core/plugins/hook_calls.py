"""One plugin's hook implementations as pluggy holds them: found, checked and called one at a
time, so a failure is the plugin's own and never aborts another plugin's call."""

from __future__ import annotations

from typing import Any

import pluggy

from kvspec_core.plugins import hookspecs


def impls_of(pm: pluggy.PluginManager, hook_name: str, plugin: object) -> list[Any]:
    """``plugin``'s implementations of ``hook_name``."""
    caller = getattr(pm.hook, hook_name)
    return [impl for impl in caller.get_hookimpls() if impl.plugin is plugin]


def check_impls(pm: pluggy.PluginManager, plugin: object) -> None:
    """Refuse the implementations pluggy accepts but the core could not call faithfully."""
    for hook_name in hookspecs.HOOK_NAMES:
        for impl in impls_of(pm, hook_name, plugin):
            if impl.kwargnames:
                raise ValueError(
                    f"{hook_name} gives argument(s) {', '.join(map(repr, impl.kwargnames))} "
                    "a default, so pluggy would never pass them; remove the default"
                )
            if impl.wrapper or impl.hookwrapper:
                raise ValueError(
                    f"{hook_name} is marked as a wrapper; the core calls every "
                    "implementation on its own, so use a plain @hookimpl"
                )


def call_impl(impl: Any, **kwargs: Any) -> Any:
    """Call one implementation with the arguments it names."""
    # pluggy passes only the arguments an implementation names; do the same.
    return impl.function(*(kwargs[arg] for arg in impl.argnames))
