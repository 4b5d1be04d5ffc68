"""Finding plugins through entry points, with the allow-list and strict mode."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Protocol

import importlib_metadata

from kvspec_core.errors import KindConflictError, PluginError
from kvspec_core.plugins.contract import ENTRY_POINT_GROUP
from kvspec_core.plugins.records import CORE_PLUGIN_NAME, PluginFailure, PluginInfo
from kvspec_core.switches import switch_value

#: Comma-separated entry-point names to load; unset loads all, empty loads none.
ALLOW_LIST_VAR = "KVSPEC_PLUGINS"
#: ``1`` makes any plugin that fails to load an error.
STRICT_VAR = "KVSPEC_STRICT_PLUGINS"


class PluginLoadWarning(UserWarning):
    """A plugin failed to load; the others keep working."""


class PluginHost(Protocol):
    """What loading needs of the manager it loads into (:class:`~kvspec_core.PluginManager`
    implements it; the manager imports this module, not the other way round)."""

    strict_plugins: bool
    failures: list[PluginFailure]
    kind_conflicts: list[KindConflictError]

    @property
    def plugins(self) -> list[PluginInfo]: ...

    def is_loaded(self, name: str) -> bool: ...

    def register(
        self,
        plugin: object,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
        withdraw_contested_kinds: bool = False,
    ) -> object: ...


def allowed_names(environ: Mapping[str, str]) -> set[str] | None:
    """The allow-list from ``KVSPEC_PLUGINS``: ``None`` for all, empty set for none."""
    raw = environ.get(ALLOW_LIST_VAR)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def is_strict(environ: Mapping[str, str]) -> bool:
    """``KVSPEC_STRICT_PLUGINS``: on for 1/true/yes/on, off when unset or 0/false/no/off
    (any case); anything else is refused (a typo must not silently turn it off)."""
    strict = switch_value(environ.get(STRICT_VAR))
    if strict is not None:
        return strict
    raise PluginError(
        f"{STRICT_VAR}={environ[STRICT_VAR]!r}: give 1, true, yes or on for strict loading, "
        "or 0, false, no, off or nothing for the default"
    )


def _dist_of(entry_point: importlib_metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = entry_point.dist
    if dist is None:
        return None, None
    return dist.name, dist.version


def load_entry_points(manager: PluginHost, environ: Mapping[str, str] | None = None) -> None:
    """Load every allowed ``kvspec.plugins`` entry point into ``manager``.

    A plugin that fails (import error, raising hook, wrong contract version, a kind another
    plugin owns, an entry-point name two distributions share) is recorded in
    ``manager.failures`` and warned about; with ``KVSPEC_STRICT_PLUGINS=1`` it raises.
    """
    env = os.environ if environ is None else environ
    allow = allowed_names(env)
    strict = is_strict(env)
    if strict:
        manager.strict_plugins = True
    by_name: dict[str, list[importlib_metadata.EntryPoint]] = {}
    for entry_point in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        by_name.setdefault(entry_point.name, []).append(entry_point)

    def fail(name: str, distribution: str | None, version: str | None, error: str) -> None:
        _add_failure(
            manager,
            PluginFailure(name=name, distribution=distribution, version=version, error=error),
        )
        message = (
            f"kvspec plugin {name!r}"
            + (f" from distribution {distribution}" if distribution else "")
            + (f" {version}" if distribution and version else "")
            + f" failed to load: {error}"
        )
        if strict:
            raise PluginError(message + f" ({STRICT_VAR}=1)")
        warnings.warn(message, PluginLoadWarning, stacklevel=3)

    if allow is not None:
        # The core is always loaded, so naming it is not a mistake.
        for unknown in sorted(allow - set(by_name) - {CORE_PLUGIN_NAME}):
            fail(
                unknown,
                None,
                None,
                f"{ALLOW_LIST_VAR} names {unknown!r} but no installed distribution provides an "
                f"entry point of that name in group {ENTRY_POINT_GROUP!r}",
            )

    for name in sorted(by_name):
        if allow is not None and name not in allow:
            continue
        if name == CORE_PLUGIN_NAME:
            # The core registers itself under this name: another distribution's entry point
            # of that name would otherwise be skipped without a word.
            for entry_point in by_name[name]:
                distribution, version = _dist_of(entry_point)
                fail(
                    name,
                    distribution,
                    version,
                    f"entry-point name {CORE_PLUGIN_NAME!r} is reserved for kvspec-core; "
                    f"rename the entry point of {entry_point.value}",
                )
            continue
        if manager.is_loaded(name):
            continue
        entry_points = by_name[name]
        distributions = sorted({str(_dist_of(ep)[0]) for ep in entry_points})
        if len(distributions) > 1:
            fail(
                name,
                ", ".join(distributions),
                None,
                f"entry point name {name!r} is provided by several distributions "
                f"({', '.join(distributions)}); uninstall all but one",
            )
            continue
        entry_point = entry_points[0]
        distribution, version = _dist_of(entry_point)
        try:
            plugin = entry_point.load()
        except Exception as error:  # an import failure of any kind must not take others down
            fail(
                name,
                distribution,
                version,
                f"importing {entry_point.value} raised {type(error).__name__}: {error}",
            )
            continue
        conflicts_before = len(manager.kind_conflicts)
        try:
            manager.register(
                plugin,
                name,
                distribution=distribution,
                version=version,
                withdraw_contested_kinds=True,
            )
        except PluginError as error:
            fail(name, distribution, version, str(error))
        for conflict in manager.kind_conflicts[conflicts_before:]:
            # Every claimant lost the kind, not only the one loaded last (which one that is
            # depends on the names' order): each is listed, the warning given once.
            for claimant in conflict.claimants:
                if claimant != name:
                    _record_failure(manager, claimant, str(conflict))
            fail(name, distribution, version, str(conflict))


def _record_failure(manager: PluginHost, name: str, error: str) -> None:
    """List ``name`` (a loaded plugin) among ``manager.failures`` with ``error``, without a
    warning of its own."""
    info = next((info for info in manager.plugins if info.name == name), None)
    _add_failure(
        manager,
        PluginFailure(
            name=name,
            distribution=None if info is None else info.distribution,
            version=None if info is None else info.version,
            error=error,
        ),
    )


def _add_failure(manager: PluginHost, failure: PluginFailure) -> None:
    if failure not in manager.failures:
        manager.failures.append(failure)
