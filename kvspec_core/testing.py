"""Helpers for plugin authors' tests; also a pytest plugin (fixtures below are auto-available).

* ``kvspec_manager`` fixture: a fresh :class:`PluginManager` with only the core's families.
* ``kvspec_loaded_manager`` fixture: a fresh manager with installed plugins loaded.
* :func:`registered` context manager: register a plugin object for one block only.
* :func:`check_spec_protocol`: the protocol checks every spec of a plugin must pass.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import attrs
import pytest

from kvspec_core.context import SizingContext
from kvspec_core.plugins.manager import PluginInfo, PluginManager
from kvspec_core.specs import KVSpec, spec_from_dict, spec_to_dict


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


def check_spec_protocol(
    spec: KVSpec, manager: PluginManager, max_model_lens: Sequence[int] = (1, 17, 4096, 131072)
) -> None:
    """Checks every spec a plugin provides must pass; raises ``AssertionError`` explaining
    which rule broke.

    * its kind is registered in ``manager`` and it survives a JSON round trip;
    * merging it with an equal copy gives the spec back;
    * startup sizing equals admission cap × page size (one formula for both);
    * per-request memory never decreases as ``max_model_len`` grows.
    """
    kind = manager.spec_kinds.kind_of(spec)
    if kind != type(spec).kind and manager.spec_kinds.class_of(kind) is type(spec):
        raise AssertionError(f"{type(spec).__name__} registered as {kind!r}, declares {type(spec).kind!r}")
    data = json.loads(json.dumps(spec_to_dict(spec)))
    restored = spec_from_dict(data, manager.spec_kinds)
    if restored != spec:
        raise AssertionError(f"JSON round trip changed the spec:\n{spec!r}\n{restored!r}")
    merged = type(spec).merge([spec, attrs.evolve(spec)], ["layer.a", "layer.b"])
    if merged != spec:
        raise AssertionError(f"merging equal specs changed the spec:\n{spec!r}\n{merged!r}")
    previous = -1
    for max_len in sorted(max_model_lens):
        ctx = SizingContext(max_model_len=max_len)
        memory = spec.max_memory_usage_bytes(ctx)
        cap = spec.max_blocks_per_request(ctx)
        if memory != cap * spec.page_size_bytes:
            raise AssertionError(
                f"max_memory_usage_bytes={memory} but max_blocks_per_request={cap} × "
                f"page_size_bytes={spec.page_size_bytes} at max_model_len={max_len}: startup "
                "sizing and runtime admission must use one formula"
            )
        if memory < previous:
            raise AssertionError(f"per-request memory decreased at max_model_len={max_len}")
        previous = memory
