"""The ``valkey`` fixture (a real server on loopback) for the remote-tier tests."""

from remote_testkit import valkey

__all__ = ["valkey"]
