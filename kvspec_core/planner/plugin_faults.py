"""Naming the plugin whose spec code raised while a plan was built.

The planner calls spec methods (page sizes, block demands, merges...) in many places; a
plugin's bug in any of them must reach the user as a :class:`PluginError` naming the plugin,
its distribution, the spec kind and the method, not as a traceback through the planner. The
method is found from the traceback: the innermost frame running a method of a spec.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from kvspec_core.errors import KVSpecError, PluginError
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs.base import KVSpec


def _spec_class_of_frame(local_self: object) -> type[KVSpec] | None:
    if isinstance(local_self, KVSpec):
        return type(local_self)
    if isinstance(local_self, type) and issubclass(local_self, KVSpec):
        return local_self  # a classmethod (merge)
    return None


def _innermost_spec_method(trace: TracebackType | None) -> tuple[type[KVSpec], str] | None:
    found = None
    while trace is not None:
        frame = trace.tb_frame
        spec_class = _spec_class_of_frame(frame.f_locals.get("self", frame.f_locals.get("cls")))
        if spec_class is not None:
            found = (spec_class, frame.f_code.co_name)
        trace = trace.tb_next
    return found


def spec_method_error(error: Exception, manager: PluginManager, action: str) -> PluginError | None:
    """The :class:`PluginError` for ``error`` raised inside a spec method during ``action``,
    or ``None`` when no spec method was running (a bug elsewhere keeps its traceback)."""
    found = _innermost_spec_method(error.__traceback__)
    if found is None:
        return None
    spec_class, method = found
    try:
        entry = manager.spec_kinds.entry_of(spec_class)
    except KVSpecError:
        kind, owner = getattr(spec_class, "kind", "") or spec_class.__name__, None
    else:
        kind, owner = entry.kind, entry.owner
    infos = {info.name: info for info in manager.plugins}
    if owner is None:
        who = "an unregistered spec class"
    else:
        distribution = infos[owner].distribution if owner in infos else None
        who = f"plugin {owner!r}" + (f" (distribution {distribution})" if distribution else "")
    return PluginError(
        f"{who} raised {type(error).__name__} in {spec_class.__name__}.{method} of spec kind "
        f"{kind!r} while {action}: {error}. This is a bug of that plugin; report it to its "
        "authors, or restrict loading with KVSPEC_PLUGINS"
    )


@contextmanager
def plugin_faults_named(manager: PluginManager, action: str) -> Iterator[None]:
    """Turn an exception a spec method raises inside the block into a :class:`PluginError`
    (chained to it); kvspec's own errors pass unchanged."""
    try:
        yield
    except KVSpecError:
        raise
    except Exception as error:
        named = spec_method_error(error, manager, action)
        if named is None:
            raise
        raise named from error
