"""Helpers for the ``kvspec plan`` tests: run the command in-process, read its JSON or error."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvspec_core.cli.main import main


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """Run ``kvspec plan ARGS --json``, expect exit 0, return the parsed report."""
    assert main(["plan", *args, "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def fails(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run, expect exit 2 with one clean error line; return stderr."""
    assert main(["plan", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvspec: error: ")
    assert "Traceback" not in captured.err
    return captured.err
