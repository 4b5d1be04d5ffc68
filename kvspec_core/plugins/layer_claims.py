"""The typed ``kvspec_layer_spec`` call: every plugin's claim for a layer, a faulty answer
isolated to its plugin (a warning when another plugin claims the layer, else an error)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

from kvspec_core.errors import KVSpecError, MissingFamilyError, PluginError, UnknownNameError
from kvspec_core.plugins import loading
from kvspec_core.plugins.hook_calls import call_impl
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.plugins.registry import SpecRegistry
from kvspec_core.specs.base import KVSpec

#: A plugin's faulty answer: its name, what it did, the exception it raised (if any).
LayerHookFault = tuple[str, str, Exception | None]


class PluginHookWarning(UserWarning):
    """A plugin's hook failed where another plugin's answer stands; planning goes on."""


def collect_layer_claims(
    impls: Iterable[tuple[str, Any]], layer: LayerConfig, spec_kinds: SpecRegistry
) -> tuple[list[tuple[str, KVSpec]], list[LayerHookFault]]:
    """Call each (plugin name, ``kvspec_layer_spec`` implementation) for ``layer``: the
    claims, and the faults still to be judged (:func:`refuse_or_warn`). A kvspec error is a
    deliberate refusal and propagates; a spec of a kind nobody registered is refused."""
    claims: list[tuple[str, KVSpec]] = []
    faults: list[LayerHookFault] = []
    for plugin_name, impl in impls:
        try:
            spec = call_impl(impl, layer=layer)
        except KVSpecError as error:
            # A deliberate refusal, but of which plugin: a faulty one refusing a layer that
            # is not its family's would otherwise read as the model config's fault.
            _add_note(
                error,
                f"raised by plugin {plugin_name!r}'s kvspec_layer_spec for layer {layer.name} "
                f"({layer.layer_type}); if that plugin is not this layer's family, it is its "
                f"bug: leave it out with {loading.ALLOW_LIST_VAR}",
            )
            raise
        except Exception as error:
            faults.append(
                (
                    plugin_name,
                    f"raised {type(error).__name__} in kvspec_layer_spec "
                    f"for layer {layer.name} ({layer.layer_type}): {error}",
                    error,
                )
            )
            continue
        if spec is None:
            continue
        if not isinstance(spec, KVSpec):
            faults.append(
                (
                    plugin_name,
                    f"returned {spec!r} for layer {layer.name} "
                    f"({layer.layer_type}); kvspec_layer_spec must return a KVSpec "
                    "or None",
                    None,
                )
            )
            continue
        try:
            spec_kinds.entry_of(spec)
        except (UnknownNameError, MissingFamilyError) as error:
            # A missing family stays a MissingFamilyError (the fix is an install); an
            # unregistered class is the plugin breaking the contract.
            missing = isinstance(error, MissingFamilyError)
            raise (MissingFamilyError if missing else PluginError)(
                f"plugin {plugin_name!r} returned a {type(spec).__name__} for layer "
                f"{layer.name}: {error}"
            ) from error
        claims.append((plugin_name, spec))
    return claims, faults


def _add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python 3.11; the same attribute before)."""
    notes = getattr(error, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        error.__notes__ = notes  # type: ignore[attr-defined]
    if note not in notes:
        notes.append(note)


def refuse_or_warn(
    label: str,
    plugin_name: str,
    fault: str,
    cause: Exception | None,
    claims: list[tuple[str, KVSpec]],
    *,
    strict: bool,
    warned: set[str],
) -> None:
    """Refuse or warn about one plugin's faulty ``kvspec_layer_spec`` answer (see
    :meth:`~kvspec_core.plugins.manager.PluginManager.layer_specs`); ``label`` names the
    plugin, ``warned`` holds the plugins already warned about (added to here)."""
    fix = (
        "This is a bug of that plugin; report it to its authors, or leave it out with "
        f"{loading.ALLOW_LIST_VAR} (the comma-separated plugin names to load)"
    )
    if strict or not claims:
        why = (
            f"{loading.STRICT_VAR}=1 makes any plugin fault an error"
            if claims
            else "no other plugin claims that layer"
        )
        raise PluginError(f"{label} {fault}; {why}. {fix}") from cause
    if plugin_name in warned:
        return
    warned.add(plugin_name)
    owners = ", ".join(repr(owner) for owner, _ in claims)
    warnings.warn(
        f"{label} {fault}; ignored, as plugin {owners} claims the layer (further faults of "
        f"this plugin are not repeated; {loading.STRICT_VAR}=1 makes them errors). {fix}",
        PluginHookWarning,
        stacklevel=4,
    )
