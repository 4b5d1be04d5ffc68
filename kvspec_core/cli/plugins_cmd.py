"""``kvspec plugins``: which plugins are loaded, what they provide, which failed."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvspec_core.cli.table import render_table
from kvspec_core.plugins.manager import PluginManager


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plugins", help="list loaded plugins, their spec kinds and hooks, and load failures"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def plugins_report(manager: PluginManager) -> dict[str, Any]:
    """The ``--json`` document: ``plugins`` (loaded) and ``failed`` (with their error)."""
    return {
        "plugins": [
            {
                "name": info.name,
                "distribution": info.distribution,
                "version": info.version,
                "spec_kinds": list(info.spec_kinds),
                "hooks": list(info.hooks),
            }
            for info in manager.plugins
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


def run(args: argparse.Namespace, manager: PluginManager) -> int:
    report = plugins_report(manager)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = [
        [p["name"], p["distribution"] or "-", p["version"] or "-", ", ".join(p["spec_kinds"]) or "-"]
        for p in report["plugins"]
    ]
    print(render_table(["plugin", "distribution", "version", "spec kinds"], rows))
    for failure in report["failed"]:
        print(f"FAILED {failure['name']} ({failure['distribution'] or '?'}): {failure['error']}")
    return 0
