"""The typed plugin-manager facade: the only code that talks to pluggy.

Every hook is called through a method here, one plugin at a time, so failures are
attributed to the plugin that caused them and never abort another plugin's call.

The checks a plugin passes before it is registered live in
:mod:`~kvspec_core.plugins.admission` and :mod:`~kvspec_core.plugins.hook_calls`; the
``kvspec_layer_spec`` call and its fault isolation in :mod:`~kvspec_core.plugins.layer_claims`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import pluggy

from kvspec_core.errors import KindConflictError, PluginError
from kvspec_core.kv_dtypes import KVCacheDtype, KVDtypeRegistry
from kvspec_core.plugins import hookspecs, loading
from kvspec_core.plugins.admission import check_contract_version, plugin_label
from kvspec_core.plugins.contract import PROJECT_NAME
from kvspec_core.plugins.hook_calls import call_impl, check_impls, impls_of
from kvspec_core.plugins.layer_claims import (
    PluginHookWarning,
    collect_layer_claims,
    refuse_or_warn,
)
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.plugins.records import CORE_PLUGIN_NAME, PluginFailure, PluginInfo
from kvspec_core.plugins.registry import SpecRegistry
from kvspec_core.specs.base import KVSpec
from kvspec_core.version import __version__

# cli.main and the tests import PluginHookWarning from here.
__all__ = ["PluginHookWarning", "PluginManager", "load_plugins"]


class PluginManager:
    """Plugins, spec kinds, KV dtypes and runtime rules of one kvspec session.

    Create one per engine (or per test); nothing is global. ``PluginManager()`` holds the
    core's own families; call :meth:`load_entry_points` (or :func:`kvspec_core.load_plugins`)
    to add installed plugins.
    """

    def __init__(self, *, include_core: bool = True, strict_plugins: bool = False) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self.spec_kinds = SpecRegistry()
        self.kv_dtypes = KVDtypeRegistry()
        self._runtime_rules: dict[str, tuple[str, Any]] = {}
        self._infos: dict[str, PluginInfo] = {}
        self.failures: list[PluginFailure] = []
        #: Kinds refused because several plugins claimed them (entry-point loading).
        self.kind_conflicts: list[KindConflictError] = []
        #: Whether a plugin's faulty hook answer is an error even where another plugin's
        #: answer stands (``KVSPEC_STRICT_PLUGINS=1`` at :meth:`load_entry_points` sets it).
        self.strict_plugins = strict_plugins
        self._warned_layer_hook_faults: set[str] = set()
        if include_core:
            from kvspec_core.plugins import builtin

            self.register(
                builtin, CORE_PLUGIN_NAME, distribution="kvspec-core", version=__version__
            )

    # ----------------------------------------------------------------- registration
    @property
    def plugins(self) -> list[PluginInfo]:
        """Loaded plugins in registration order."""
        return list(self._infos.values())

    def is_loaded(self, name: str) -> bool:
        return name in self._infos

    def register(
        self,
        plugin: object,
        name: str,
        *,
        distribution: str | None = None,
        version: str | None = None,
        withdraw_contested_kinds: bool = False,
    ) -> PluginInfo:
        """Register ``plugin`` (a module or object with hook implementations).

        It must declare ``kvspec_contract_version == CONTRACT_VERSION``. Its registration
        hooks run at once; if any of them fails, nothing it registered is kept and
        :class:`PluginError` names the plugin, its distribution and the cause.

        A spec kind another plugin already holds is such a failure, unless
        ``withdraw_contested_kinds`` (entry-point loading, where nobody can choose): then
        neither plugin keeps the kind (the core's kinds stay the core's), the plugin's other
        registrations stand, and a :class:`KindConflictError` naming both is appended to
        :attr:`kind_conflicts`.
        """
        label = plugin_label(name, distribution)
        if name in self._infos:
            raise PluginError(f"{label}: a plugin named {name!r} is already registered")
        check_contract_version(plugin, name, label, distribution)
        if self._pm.is_registered(plugin):
            # Checked here because pluggy's own refusal would send us into the rollback below,
            # which would unregister the plugin from under its first name.
            raise PluginError(
                f"{label}: this plugin object is already registered as "
                f"{self._pm.get_name(plugin)!r}"
            )
        try:
            self._pm.register(plugin, name=name)
            self._pm.check_pending()
            check_impls(self._pm, plugin)
        except Exception as error:  # pluggy inspects every attribute of the plugin object
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
            raise PluginError(
                f"{label} has invalid hook implementations: {type(error).__name__}: {error}"
            ) from error
        contested: list[KindConflictError] = []
        try:
            self._run_registration_hooks(
                plugin, name, contested if withdraw_contested_kinds else None
            )
        except Exception as error:
            self._rollback(plugin, name)
            if isinstance(error, PluginError):
                raise PluginError(f"{label}: {error}") from error
            raise PluginError(
                f"{label} raised {type(error).__name__} while registering: {error}"
            ) from error
        hooks = tuple(hook for hook in hookspecs.HOOK_NAMES if impls_of(self._pm, hook, plugin))
        info = PluginInfo(
            name=name,
            distribution=distribution,
            version=version,
            spec_kinds=tuple(self.spec_kinds.kinds(owner=name)),
            hooks=hooks,
        )
        self._infos[name] = info
        for conflict in contested:
            self._withdraw_kind(conflict, name, distribution)
        return info

    def _withdraw_kind(
        self, conflict: KindConflictError, claimant: str, distribution: str | None
    ) -> None:
        """Take ``conflict.kind`` from its holder and refuse it to ``claimant`` too."""
        kinds = self.spec_kinds
        holder = kinds.owner_of(conflict.kind) if conflict.kind in kinds else None
        claimants = self.spec_kinds.withdraw(conflict.kind, claimant)
        if holder is not None:
            info = self._infos[holder]
            self._infos[holder] = attrs.evolve(
                info, spec_kinds=tuple(k for k in info.spec_kinds if k != conflict.kind)
            )
            self._runtime_rules.pop(conflict.kind, None)
        labels = [
            f"{name!r} ({self._infos[name].distribution or 'no distribution'})"
            if name in self._infos
            else repr(name)
            for name in claimants
        ]
        self.kind_conflicts.append(
            KindConflictError(
                f"spec kind {conflict.kind!r} is claimed by plugins {', '.join(labels)}; none of "
                "them gets it (their other kinds load): uninstall all but one of them, or restrict "
                "loading with KVSPEC_PLUGINS",
                kind=conflict.kind,
                claimants=claimants,
            )
        )

    def unregister(self, name: str) -> None:
        """Remove a plugin and everything it registered."""
        plugin = self._pm.get_plugin(name)
        if plugin is None:
            raise PluginError(f"no plugin named {name!r} is registered")
        self._rollback(plugin, name)
        del self._infos[name]

    def _rollback(self, plugin: object, name: str) -> None:
        self.spec_kinds.remove_owner(name)
        self.kv_dtypes.remove_owner(name)
        for kind in [k for k, (owner, _) in self._runtime_rules.items() if owner == name]:
            del self._runtime_rules[kind]
        if self._pm.is_registered(plugin):
            self._pm.unregister(plugin)

    def _run_registration_hooks(
        self, plugin: object, name: str, contested: list[KindConflictError] | None = None
    ) -> None:
        """Run ``plugin``'s registration hooks; with ``contested``, a kind another plugin
        (not the core) holds or claimed is skipped and its conflict appended there."""

        def register_kind(
            spec_class: type[KVSpec], uniform_base: type[KVSpec] | None = None
        ) -> None:
            try:
                entry = self.spec_kinds.check(spec_class, name, uniform_base)
            except KindConflictError as conflict:
                if contested is None or CORE_PLUGIN_NAME in conflict.claimants:
                    raise
                contested.append(conflict)
                return
            self.spec_kinds.add(entry)

        def register_kv_dtype(kv_dtype: KVCacheDtype) -> None:
            self.kv_dtypes.register(kv_dtype, name)

        def register_rules(kind: str, rules: Any) -> None:
            if contested is not None and (
                kind in self.spec_kinds.contested_kinds()
                or any(conflict.kind == kind for conflict in contested)
            ):
                return  # the kind is refused to every claimant; so are its rules
            owner = self.spec_kinds.owner_of(kind)
            if owner != name:
                raise PluginError(f"runtime rules for kind {kind!r}, which plugin {owner!r} owns")
            if not callable(rules):
                raise PluginError(
                    f"runtime rules for kind {kind!r} must be a factory rules(spec, ctx) (usually "
                    f"the rules class), not {rules!r}"
                )
            self._runtime_rules[kind] = (name, rules)

        registrations: list[tuple[str, Callable[..., None]]] = [
            ("kvspec_register_spec_kinds", register_kind),
            ("kvspec_register_kv_dtypes", register_kv_dtype),
            ("kvspec_register_runtime_rules", register_rules),
        ]
        for hook_name, register in registrations:
            for impl in impls_of(self._pm, hook_name, plugin):
                call_impl(impl, register=register)

    # ----------------------------------------------------------------- loading
    def load_entry_points(self, environ: dict[str, str] | None = None) -> None:
        """Load installed plugins from the ``kvspec.plugins`` entry-point group.

        Honors ``KVSPEC_PLUGINS`` and ``KVSPEC_STRICT_PLUGINS`` from ``environ`` (default:
        ``os.environ``); strict mode also sets :attr:`strict_plugins`. Idempotent: plugins
        already loaded are skipped.
        """
        loading.load_entry_points(self, environ)

    # ----------------------------------------------------------------- typed hook calls
    def layer_specs(self, layer: LayerConfig) -> list[tuple[str, KVSpec]]:
        """Every (plugin name, spec) claim for ``layer``, in registration order.

        A plugin whose hook raises (anything but a kvspec error, which is a deliberate
        refusal) or returns something other than a spec or ``None`` is isolated: when another
        plugin claims the layer, its fault is a :class:`PluginHookWarning` (once per plugin)
        and the other claims stand; when none does, or under :attr:`strict_plugins`, it is a
        :class:`PluginError` naming the plugin, its distribution, the layer and the fix.
        """
        claims, faults = collect_layer_claims(
            self._impls_in_order("kvspec_layer_spec"), layer, self.spec_kinds
        )
        for plugin_name, fault, cause in faults:
            info = self._infos[plugin_name]
            refuse_or_warn(
                plugin_label(plugin_name, info.distribution),
                plugin_name,
                fault,
                cause,
                claims,
                strict=self.strict_plugins,
                warned=self._warned_layer_hook_faults,
            )
        return claims

    def runtime_rules(self, kind: str) -> Any | None:
        """Rules a plugin registered for ``kind``, or ``None`` (full attention's apply)."""
        entry = self._runtime_rules.get(kind)
        return entry[1] if entry is not None else None

    def _impls_in_order(self, hook_name: str) -> Iterator[tuple[str, Any]]:
        caller = getattr(self._pm.hook, hook_name)
        impls = {id(impl.plugin): impl for impl in caller.get_hookimpls()}
        for name in self._infos:
            plugin = self._pm.get_plugin(name)
            impl = impls.get(id(plugin))
            if impl is not None:
                yield name, impl


def load_plugins(environ: Mapping[str, str] | None = None) -> PluginManager:
    """A fresh :class:`PluginManager` with the core families and installed plugins loaded
    (``environ`` as for :meth:`PluginManager.load_entry_points`)."""
    manager = PluginManager()
    manager.load_entry_points(dict(environ) if environ is not None else None)
    return manager
