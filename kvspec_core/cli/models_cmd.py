"""``kvspec models``: the bundled model presets and the families each needs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvspec_core.cli.table import render_table
from kvspec_core.models.catalog import PRESET_SOURCES, load_preset
from kvspec_core.models.families import model_families
from kvspec_core.plugins.manager import PluginManager


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "models", help="list the bundled model presets and the families (plugins) each needs"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def models_report(manager: PluginManager) -> dict[str, Any]:
    """The ``--json`` document: ``models``, one entry per preset (``name``, ``source``, and
    ``layer_types``, ``spec_kinds``, ``distributions``, ``missing_distributions``, ``error``,
    ``default_max_model_len``)."""
    models = []
    for name, source in PRESET_SOURCES.items():
        families = model_families(load_preset(name), manager, name=name)
        models.append({"name": name, "source": source, **families.to_dict()})
    return {"models": models}


def _counts(mapping: dict[str, int]) -> str:
    return ", ".join(f"{key} ×{count}" for key, count in mapping.items()) or "-"


def run(args: argparse.Namespace, manager: PluginManager) -> int:
    report = models_report(manager)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    rows = [
        [
            model["name"],
            _counts(model["layer_types"]),
            _counts(model["spec_kinds"]),
            ", ".join(model["distributions"]),
        ]
        for model in report["models"]
    ]
    print(render_table(["preset", "layer types", "spec kinds", "provided by"], rows))
    for model in report["models"]:
        if model["error"] is not None:
            print(f"CANNOT PLAN {model['name']}: {model['error']}")
    return 0
