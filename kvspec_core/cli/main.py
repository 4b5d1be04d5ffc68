"""Entry point of the ``kvspec`` command: builds the parser from the subcommand modules.

Each module in :data:`COMMANDS` exposes ``add_parser(subparsers)``, which registers its
subcommand and sets ``handler(args, manager) -> int`` as the parser default. Errors kvspec
raises on purpose become one ``kvspec: error: ...`` line and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from collections.abc import Sequence

from kvspec_core import __version__
from kvspec_core.errors import KVSpecError
from kvspec_core.plugins.loading import PluginLoadWarning
from kvspec_core.plugins.manager import PluginManager

#: Subcommand modules under ``kvspec_core.cli``, in help order.
COMMANDS = ("plugins_cmd", "models_cmd", "plan_cmd", "simulate_cmd")

#: Exit code for bad input (argparse uses the same).
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvspec",
        description="Describe, plan and manage the KV cache of LLM inference engines.",
    )
    parser.add_argument("--version", action="version", version=f"kvspec {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in COMMANDS:
        module = importlib.import_module(f"kvspec_core.cli.{module_name}")
        module.add_parser(subparsers)
    return parser


def load_manager() -> PluginManager:
    """A fresh manager with installed plugins; load failures are printed, not raised
    (unless strict mode makes them errors)."""
    manager = PluginManager()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PluginLoadWarning)
        manager.load_entry_points()
    for warning in caught:
        print(f"kvspec: warning: {warning.message}", file=sys.stderr)
    return manager


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        manager = load_manager()
        return int(args.handler(args, manager))
    except KVSpecError as error:
        print(f"kvspec: error: {error}", file=sys.stderr)
        return EXIT_USAGE
