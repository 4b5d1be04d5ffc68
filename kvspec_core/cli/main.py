"""Entry point of the ``kvspec`` command: builds the parser from the subcommand modules.

Each module in :data:`COMMANDS` exposes ``add_parser(subparsers)``, which registers its
subcommand and sets ``handler(args, manager) -> int`` as the parser default. Errors kvspec
raises on purpose become one ``kvspec: error: ...`` line and exit code 2, never a traceback.
Standard output that cannot be written is handled here for every command: a reader that went
away (``kvspec models | head -1``) ends quietly with :data:`EXIT_BROKEN_PIPE`; any other write
failure (a full disk) is one error line and :data:`EXIT_FAILURE`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from kvspec_core import __version__
from kvspec_core.errors import KVSpecError
from kvspec_core.plugins.loading import PluginLoadWarning
from kvspec_core.plugins.manager import PluginHookWarning, PluginManager

#: Subcommand modules under ``kvspec_core.cli``, in help order.
COMMANDS = ("plugins_cmd", "models_cmd", "plan_cmd", "simulate_cmd")

#: Exit code for bad input (argparse uses the same).
EXIT_USAGE = 2
#: Exit code when the output cannot be written (a full disk, an I/O error).
EXIT_FAILURE = 1
#: Exit code when the reader of the output went away (``kvspec models | head -1``): the
#: status a shell reports for a process ended by SIGPIPE (128 + 13), as for ``yes | head``.
EXIT_BROKEN_PIPE = 141


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
    real_stdout = sys.stdout
    sys.stdout = _GuardedOutput(real_stdout)
    try:
        try:
            return _run(argv)
        finally:
            # Flushed here, not at interpreter exit, so a failure is reported like any other.
            sys.stdout.flush()
    except _OutputFailure as failure:
        _discard_further_output(real_stdout)
        if isinstance(failure.cause, BrokenPipeError):
            return EXIT_BROKEN_PIPE
        print(
            f"kvspec: error: cannot write the output to standard output: {failure.cause}",
            file=sys.stderr,
        )
        return EXIT_FAILURE
    finally:
        sys.stdout = real_stdout


#: A value that starts like a negative number (``-1GiB``, ``-0.5``), which argparse would
#: take for an option and answer "expected one argument" instead of the option's own check.
_NEGATIVE_VALUE = re.compile(r"-\.?\d")


def negative_values_joined(argv: Sequence[str]) -> list[str]:
    """``argv`` with each long option followed by a negative-looking value written as
    ``--option=value``, so the option's own check names what is wrong with it (``--overhead
    -1GiB``: "is negative", not argparse's "expected one argument"). No kvspec option or
    argument is spelled like a negative number, so nothing else changes meaning."""
    joined: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            joined.append(token)
            joined.extend(tokens)
            break
        if token.startswith("--") and "=" not in token and len(token) > 2:
            following = next(tokens, None)
            if following is not None and _NEGATIVE_VALUE.match(following):
                joined.append(f"{token}={following}")
                continue
            joined.append(token)
            if following is not None:
                joined.append(following)
            continue
        joined.append(token)
    return joined


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(negative_values_joined(sys.argv[1:] if argv is None else argv))
    try:
        manager = load_manager()
        with warnings.catch_warnings():
            warnings.simplefilter("always", PluginHookWarning)
            warnings.showwarning = _plugin_warnings_as_lines(warnings.showwarning)
            return int(args.handler(args, manager))
    except KVSpecError as error:
        print(f"kvspec: error: {error}", file=sys.stderr)
        for note in getattr(error, "__notes__", ()):
            print(f"kvspec: note: {note}", file=sys.stderr)
        return EXIT_USAGE


def _plugin_warnings_as_lines(show: Callable[..., None]) -> Callable[..., None]:
    """A ``warnings.showwarning`` that prints a :class:`PluginHookWarning` (a plugin's hook
    failed where another plugin's answer stands) as one ``kvspec: warning:`` line and hands
    every other warning to ``show``."""

    def show_warning(
        message: Warning | str, category: type[Warning], *rest: Any, **options: Any
    ) -> None:
        if issubclass(category, PluginHookWarning):
            print(f"kvspec: warning: {message}", file=sys.stderr)
        else:
            show(message, category, *rest, **options)

    return show_warning


class _OutputFailure(Exception):
    """Writing to standard output failed with ``cause``."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _GuardedOutput:
    """Standard output whose write failures become :class:`_OutputFailure`, so that they are
    told apart from an ``OSError`` of a file the command reads or writes."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as error:
            raise _OutputFailure(error) from error

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as error:
            raise _OutputFailure(error) from error

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _discard_further_output(stream: TextIO) -> None:
    """Point the output's descriptor at the null device, so that the interpreter's own flush
    at exit does not fail again (the recipe of the SIGPIPE note in Python's ``signal`` docs).
    A stream without a descriptor (a test's capture) has nothing to redirect."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, descriptor)
    finally:
        os.close(null)
