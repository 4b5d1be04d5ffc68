"""Helpers for plugin authors' tests; also a pytest plugin (fixtures below are auto-available).

* ``kvspec_manager`` fixture: a fresh :class:`PluginManager` with only the core's families.
* ``kvspec_loaded_manager`` fixture: a fresh manager with installed plugins loaded.
* :func:`registered` context manager: register a plugin object for one block only.
* :func:`check_spec_protocol`: the protocol checks every spec of a plugin must pass.
* :func:`check_sizing_invariants`: sizing monotonicity and the one-formula rule at one
  context, for plugins' hypothesis tests.
* :func:`model_layers_of` / :func:`model_layer`: the :class:`LayerConfig` objects the core's
  config ingestion builds from a real ``config.json``, exactly as plugins receive them.
* :func:`manager_with`: a fresh manager holding the core and one plugin.
* :func:`plugins_cli_report`: what ``kvspec plugins --json`` reports for given plugins.
* :func:`kvspec_imports_outside`: ``kvspec_*`` imports of source files beyond the allowed ones.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest

from kvspec_core.context import SizingContext
from kvspec_core.models.ingest import model_layers
from kvspec_core.planner.spec_answers import (
    SpecAnswerError,
    check_spec_answers,
    checked_blocks_per_request,
)
from kvspec_core.plugins.layer_config import LayerConfig, PlanOptions
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.plugins.records import PluginInfo
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


def manager_with(plugin: object, name: str) -> PluginManager:
    """A fresh manager holding the core's families and ``plugin`` registered as ``name``
    (installed plugins are not loaded, so a plugin's tests see no other family)."""
    manager = PluginManager()
    manager.register(plugin, name)
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
    * every value the planner reads is usable: sizes and counts are positive ints (never a
      bool, 0, a negative or a str), the admission cap a non-negative int, flags bools;
    * merging it with an equal copy gives the spec back (that ``merge`` is a classmethod,
      registration checks);
    * startup sizing equals admission cap × page size (one formula for both);
    * per-request memory never decreases as ``max_model_len`` grows.
    """
    entry = manager.spec_kinds.entry_of(spec)
    try:
        check_spec_answers(spec, "the spec under test")
        for max_len in max_model_lens:
            checked_blocks_per_request(
                spec, SizingContext(max_model_len=max_len), "the spec under test"
            )
    except SpecAnswerError as error:
        raise AssertionError(str(error)) from error

    if entry.spec_class is not type(spec):
        # Found only through an ancestor: serialised, it would come back as that ancestor.
        raise AssertionError(
            f"{type(spec).__name__} (kind {type(spec).kind!r}) is not registered itself; the "
            f"registry resolves it through {entry.spec_class.__name__} (kind {entry.kind!r}). "
            "Register it through the kvspec_register_spec_kinds hook"
        )
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
        memory = _checked_startup_memory(spec, ctx, f"max_model_len={max_len}")
        if memory < previous:
            raise AssertionError(f"per-request memory decreased at max_model_len={max_len}")
        previous = memory


def check_sizing_invariants(
    spec: KVSpec, ctx: SizingContext, *, longer_by: int, busier_by: int
) -> None:
    """Sizing rules every spec keeps around ``ctx``; raises ``AssertionError`` naming the
    broken one. Meant for hypothesis tests drawing ``spec``, ``ctx`` and the two increments.

    * per-request memory and the block-table width never decrease when ``max_model_len``
      grows by ``longer_by``;
    * the admission cap never decreases when ``max_in_flight_tokens`` grows by ``busier_by``;
    * at ``ctx`` and at both grown contexts, startup sizing equals admission cap × page size.
    """
    longer = attrs.evolve(ctx, max_model_len=ctx.max_model_len + longer_by)
    busier = attrs.evolve(ctx, max_in_flight_tokens=ctx.max_in_flight_tokens + busier_by)
    memory, longer_memory = spec.max_memory_usage_bytes(ctx), spec.max_memory_usage_bytes(longer)
    if longer_memory < memory:
        raise AssertionError(
            f"per-request memory fell from {memory} to {longer_memory} when max_model_len grew "
            f"from {ctx.max_model_len} to {longer.max_model_len}"
        )
    width = spec.block_table_width(ctx, ctx.max_model_len)
    longer_width = spec.block_table_width(longer, longer.max_model_len)
    if longer_width < width:
        raise AssertionError(
            f"block-table width fell from {width} to {longer_width} when max_model_len grew "
            f"from {ctx.max_model_len} to {longer.max_model_len}"
        )
    cap, busier_cap = spec.max_blocks_per_request(ctx), spec.max_blocks_per_request(busier)
    if busier_cap < cap:
        raise AssertionError(
            f"admission cap fell from {cap} to {busier_cap} when max_in_flight_tokens grew from "
            f"{ctx.max_in_flight_tokens} to {busier.max_in_flight_tokens}"
        )
    for context in (ctx, longer, busier):
        _checked_startup_memory(spec, context, repr(context))


def _checked_startup_memory(spec: KVSpec, ctx: SizingContext, where: str) -> int:
    """``spec``'s startup memory at ``ctx``, refused unless it is admission cap × page size."""
    memory = spec.max_memory_usage_bytes(ctx)
    cap = spec.max_blocks_per_request(ctx)
    if memory != cap * spec.page_size_bytes:
        raise AssertionError(
            f"max_memory_usage_bytes={memory} but max_blocks_per_request={cap} × "
            f"page_size_bytes={spec.page_size_bytes} at {where}: startup sizing and runtime "
            "admission must use one formula"
        )
    return memory


def model_layers_of(
    config: Mapping[str, Any], manager: PluginManager, options: PlanOptions | None = None
) -> tuple[LayerConfig, ...]:
    """Every cache-holding layer the core builds from ``config`` (a parsed ``config.json``,
    nested ``text_config`` included) under ``options`` (default :class:`PlanOptions`): typed,
    with attention geometry resolved on one TP rank, exactly what ``kvspec_layer_spec`` hooks
    receive. ``manager`` resolves the KV-cache dtype, so register the plugin that provides a
    non-core one first."""
    return model_layers(config, options if options is not None else PlanOptions(), manager).layers


def model_layer(
    config: Mapping[str, Any],
    index: int,
    manager: PluginManager,
    *,
    options: PlanOptions | None = None,
) -> LayerConfig:
    """The layer at model position ``index`` (``LayerConfig.index``, not the position among
    cache-holding layers) as the core builds it from ``config``; see :func:`model_layers_of`.

    Raises ``LookupError`` naming the cache-holding indices when ``index`` is not one of them
    (out of range, or an MLP-only layer the core skips)."""
    layers = model_layers_of(config, manager, options)
    for layer in layers:
        if layer.index == index:
            return layer
    indices = [layer.index for layer in layers]
    raise LookupError(
        f"the config has no cache-holding layer at index {index}; its cache-holding layers are "
        f"at {indices[:8]}{'...' if len(indices) > 8 else ''} ({len(indices)} in all)"
    )


def plugins_cli_report(allowed: str, *, timeout: float = 120) -> dict[str, Any]:
    """The parsed output of ``python -m kvspec_core plugins --json`` run in a subprocess with
    ``KVSPEC_PLUGINS=allowed`` (a comma-separated list of plugin names); raises
    ``subprocess.CalledProcessError`` when the command fails."""
    result = subprocess.run(
        [sys.executable, "-m", "kvspec_core", "plugins", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "KVSPEC_PLUGINS": allowed},
        timeout=timeout,
        check=True,
    )
    return json.loads(result.stdout)


def kvspec_imports_outside(paths: Iterable[Path], allowed: Iterable[str]) -> list[str]:
    """``"<file>: <module>"`` for every ``import``/``from`` of a top-level ``kvspec_*`` package
    not in ``allowed``, across the Python files ``paths``; empty when a plugin depends only on
    what it declares. Parsed, not pattern-matched, so imports inside functions count too."""
    permitted = set(allowed)
    found: list[str] = []
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top.startswith("kvspec_") and top not in permitted:
                    found.append(f"{path}: {module}")
    return found
