"""The ``valkey`` fixture: a real key-value server on loopback, stopped after the test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from valkey_server import NO_SERVER, ServerProcess, running_server, server_binary  # noqa: E402


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server on 127.0.0.1 on a free port, no persistence; stopped after the test, also
    when it fails. Skips only when there is no server binary."""
    binary = server_binary()
    if binary is None or not binary.exists():
        pytest.skip(NO_SERVER)
    with running_server(tmp_path) as server:
        yield server
