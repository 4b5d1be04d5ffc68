"""What a plugin object must declare before the manager registers it: the hook contract
version this core implements, checked without trusting the object."""

from __future__ import annotations

from kvspec_core.errors import PluginError
from kvspec_core.plugins.contract import CONTRACT_VERSION


def plugin_label(name: str, distribution: str | None) -> str:
    """``plugin 'name' (distribution dist)``: how messages name a plugin."""
    return f"plugin {name!r}" + (f" (distribution {distribution})" if distribution else "")


def check_contract_version(
    plugin: object, name: str, label: str, distribution: str | None = None
) -> None:
    """Refuse ``plugin`` (registered as ``name`` from ``distribution``, ``label`` in
    messages) unless it declares ``kvspec_contract_version == CONTRACT_VERSION``, the int
    itself."""
    try:
        declared = getattr(plugin, "kvspec_contract_version", None)
    except Exception as error:  # any object may come out of an entry point
        raise PluginError(
            f"{label} raised {type(error).__name__} when asked for kvspec_contract_version: {error}"
        ) from error
    if declared is None:
        raise PluginError(
            f"{label} does not declare kvspec_contract_version; this core implements "
            f"contract {CONTRACT_VERSION}"
        )
    # ``True == 1`` and ``1.0 == 1`` in Python; only the int itself is the contract.
    if type(declared) is not int or declared != CONTRACT_VERSION:
        raise PluginError(
            f"{label} targets hook contract version {declared!r}, but this kvspec-core "
            f"implements version {CONTRACT_VERSION}; install a {distribution or name} release "
            f"built for contract {CONTRACT_VERSION}"
        )
