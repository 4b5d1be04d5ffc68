"""``kvspec plugins``: which plugins are loaded, what they provide, which failed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvspec_core.cli.table import render_table
from kvspec_core.plugins.contract import CONTRACT_VERSION
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.plugins.records import CORE_PLUGIN_NAME


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plugins", help="list loaded plugins, their spec kinds and hooks, and load failures"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def plugins_report(manager: PluginManager) -> dict[str, Any]:
    """The ``--json`` document: ``core`` (the core's own families and KV-cache dtypes),
    ``plugins`` (loaded entry-point plugins, each with the kinds and dtypes it registered)
    and ``failed`` (plugins that did not load, with their error)."""
    core = next(info for info in manager.plugins if info.name == CORE_PLUGIN_NAME)
    return {
        "core": {
            "distribution": core.distribution,
            "version": core.version,
            "contract_version": CONTRACT_VERSION,
            "spec_kinds": list(core.spec_kinds),
            "kv_cache_dtypes": _dtypes_of(manager, CORE_PLUGIN_NAME),
        },
        "plugins": [
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "spec_kinds": list(info.spec_kinds),
                "kv_cache_dtypes": _dtypes_of(manager, info.name),
                "hooks": list(info.hooks),
            }
            for info in manager.plugins
            if info.name != CORE_PLUGIN_NAME
        ],
        "failed": [
            {
                "name": failure.name,
                "distribution": failure.distribution,
                "version": failure.version,
                "error": failure.error,
            }
            for failure in manager.failures
        ],
    }


def _dtypes_of(manager: PluginManager, owner: str) -> list[str]:
    """The KV-cache dtype names ``owner`` registered (a plugin's are its own, not the
    core's)."""
    dtypes = manager.kv_dtypes
    return [name for name in dtypes.names() if dtypes.owner_of(name) == owner]


def run(args: argparse.Namespace, manager: PluginManager) -> int:
    report = plugins_report(manager)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    core = report["core"]
    rows = [["(core)", core["distribution"], core["version"], ", ".join(core["spec_kinds"])]]
    rows += [
        [
            p["name"],
            p["distribution"] or "-",
            p["version"] or "-",
            ", ".join(p["spec_kinds"]) or "-",
        ]
        for p in report["plugins"]
    ]
    print(render_table(["plugin", "distribution", "version", "spec kinds"], rows))
    print(f"hook contract version {CONTRACT_VERSION}")
    for failure in report["failed"]:
        print(f"FAILED {failure['name']} ({failure['distribution'] or '?'}): {failure['error']}")
    return 0
