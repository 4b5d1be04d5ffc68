"""Naming the plugin whose spec code raised while a plan was built.

The planner calls spec methods (page sizes, block demands, merges...) in many places; a
plugin's bug in any of them must reach the user as a :class:`PluginError` naming the plugin,
its distribution, the spec kind and the method, not as a traceback through the planner. The
method is found from the traceback: the innermost frame running a method of a spec. A method
that returns instead of raising but answers something unusable (a page of 0 bytes, a negative
block count) is caught by :mod:`kvspec_core.planner.spec_answers` and named here the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

from kvspec_core.errors import KVSpecError, PluginError
from kvspec_core.planner.spec_answers import SpecAnswerError
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


def _plugin_of(spec_class: type[KVSpec], manager: PluginManager) -> tuple[str, str]:
    """``(who, kind)``: the plugin owning ``spec_class`` with its distribution, and its kind."""
    try:
        entry = manager.spec_kinds.entry_of(spec_class)
    except KVSpecError:
        return "an unregistered spec class", getattr(spec_class, "kind", "") or spec_class.__name__
    infos = {info.name: info for info in manager.plugins}
    distribution = infos[entry.owner].distribution if entry.owner in infos else None
    who = f"plugin {entry.owner!r}" + (f" (distribution {distribution})" if distribution else "")
    return who, entry.kind


#: What every named plugin fault ends with: whose bug it is and how to plan without it.
_FIX = (
    "This is a bug of that plugin; report it to its authors, or leave it out with "
    "KVSPEC_PLUGINS (the comma-separated plugin names to load)"
)


def spec_method_error(error: Exception, manager: PluginManager, action: str) -> PluginError | None:
    """The :class:`PluginError` for ``error`` raised inside a spec method during ``action``,
    or ``None`` when no spec method was running (a bug elsewhere keeps its traceback)."""
    found = _innermost_spec_method(error.__traceback__)
    if found is None:
        return None
    spec_class, method = found
    who, kind = _plugin_of(spec_class, manager)
    return PluginError(
        f"{who} raised {type(error).__name__} in {spec_class.__name__}.{method} of spec kind "
        f"{kind!r} while {action}: {error}. {_FIX}"
    )


def spec_answer_error(error: SpecAnswerError, manager: PluginManager, action: str) -> PluginError:
    """The :class:`PluginError` naming the plugin whose spec gave the bad answer ``error``."""
    who, _ = _plugin_of(error.spec_class, manager)
    return PluginError(f"{who}: {error.describe()} (while {action}). {_FIX}")


@contextmanager
def plugin_faults_named(manager: PluginManager, action: str) -> Iterator[None]:
    """Turn an exception a spec method raises inside the block, or a bad answer of one
    (:class:`SpecAnswerError`), into a :class:`PluginError` naming the plugin (chained to
    it); kvspec's own errors pass unchanged."""
    try:
        yield
    except SpecAnswerError as error:
        raise spec_answer_error(error, manager, action) from error
    except KVSpecError:
        raise
    except Exception as error:
        named = spec_method_error(error, manager, action)
        if named is None:
            raise
        raise named from error
