"""The core's test server helpers (tests/remote_store/valkey_server.py), for these tests."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests" / "remote_store"))

from valkey_server import (
    NO_SERVER,
    ServerProcess,
    running_server,
    server_binary,
)

__all__ = ["NO_SERVER", "ServerProcess", "running_server", "server_binary"]
