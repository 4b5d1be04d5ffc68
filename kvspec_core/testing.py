"""Helpers for plugin authors' tests; also a pytest plugin (fixtures below are auto-available).

* ``kvspec_manager`` fixture: a fresh :class:`PluginManager` with only the core's families.
* ``kvspec_loaded_manager`` fixture: a fresh manager with installed plugins loaded.
* :func:`registered` context manager: register a plugin object for one block only.
* :func:`check_spec_protocol`: the protocol checks every spec of a plugin must pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvspec_core.plugins.manager import PluginInfo, PluginManager


@pytest.fixture
def kvspec_manager() -> PluginManager:
    """A fresh plugin manager holding only the core's families."""
    return PluginManager()


@pytest.fixture
def kvspec_loaded_manager() -> PluginManager:
    """A fresh plugin manager with every installed (and allowed) plugin loaded."""
    manager = PluginManager()
    manager.load_entry_points()
    return manager


@contextmanager
def registered(manager: PluginManager, plugin: object, name: str) -> Iterator[PluginInfo]:
    """Register ``plugin`` under ``name`` for the duration of the ``with`` block."""
    info = manager.register(plugin, name)
    try:
        yield info
    finally:
        if manager.is_loaded(name):
            manager.unregister(name)
