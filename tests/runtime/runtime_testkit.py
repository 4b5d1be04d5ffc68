"""Shared helpers of the runtime allocator tests: small specs, a plugin manager with the
hybrid families, and a shadow model that checks every prefix hit independently of the
allocator's rules (what each family needs to resume, and what each block really holds)."""

from __future__ import annotations

import functools
import importlib
import math
import pkgutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import torch

from kvspec_core import FullAttentionSpec, PluginManager, SizingContext
from kvspec_core.runtime import Allocated, CachedPrefix, KVCacheAllocator, Request
from kvspec_core.runtime.tiers import LOAD, Transfer
from kvspec_core.specs.base import KVSpec


def manager_with_families() -> PluginManager:
    """A fresh manager with the sliding-window, chunked-local and Mamba plugins."""
    from kvspec_chunked_local import plugin as chunked_plugin
    from kvspec_mamba import plugin as mamba_plugin
    from kvspec_sliding_window import plugin as sliding_plugin

    manager = PluginManager()
    manager.register(sliding_plugin, "sliding_window")
    manager.register(chunked_plugin, "chunked_local")
    manager.register(mamba_plugin, "mamba")
    return manager


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16
    )


def sliding(block_size: int, window: int) -> KVSpec:
    from kvspec_sliding_window.specs import SlidingWindowSpec

    return SlidingWindowSpec(
        block_size=block_size,
        sliding_window=window,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
    )


def chunked(block_size: int, chunk: int) -> KVSpec:
    from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec

    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        attention_chunk_size=chunk,
        num_kv_heads=1,
        head_size=8,
        dtype=torch.float16,
    )


def mamba(block_size: int) -> KVSpec:
    from kvspec_mamba.specs import MambaSpec

    return MambaSpec(block_size=block_size, shapes=((2, 4),), dtypes=(torch.float32,))


def context(max_model_len: int = 64, in_flight: int = 8) -> SizingContext:
    return SizingContext(
        max_model_len=max_model_len, max_in_flight_tokens=in_flight, mamba_cache_mode="align"
    )


def make_allocator(
    specs: Sequence[KVSpec],
    num_blocks: int | Sequence[int],
    pool_of_group: Sequence[int] | None = None,
    ctx: SizingContext | None = None,
    **options: object,
) -> KVCacheAllocator:
    return KVCacheAllocator(
        list(specs),
        num_blocks,
        ctx or context(),
        pool_of_group=pool_of_group,
        manager=manager_with_families(),
        hash_salt=b"tests",
        **options,  # type: ignore[arg-type]
    )


def needed_indices(spec: KVSpec, block_tokens: int, position: int) -> range:
    """Block indices a family needs to resume at ``position``, from first principles
    (independent of the allocator's rules)."""
    end = position // block_tokens
    kind = spec.kind
    if kind == "sliding_window":
        start = max(0, position - spec.sliding_window + 1)  # type: ignore[attr-defined]
        return range(start // block_tokens, end)
    if kind == "chunked_local_attention":
        chunk = spec.attention_chunk_size  # type: ignore[attr-defined]
        return range(position // chunk * chunk // block_tokens, end)
    if kind == "mamba":
        return range(end - 1, end) if position else range(0)
    return range(0, end)


def live_indices(spec: KVSpec, block_tokens: int, computed: int) -> range:
    """Block indices a running request with ``computed`` tokens must still hold for its
    next step (independent of the allocator's rules)."""
    if computed == 0:
        return range(0)
    kind = spec.kind
    end = -(-computed // block_tokens)
    if kind == "sliding_window":
        start = max(0, computed - spec.sliding_window + 1)  # type: ignore[attr-defined]
        return range(start // block_tokens, end)
    if kind == "chunked_local_attention":
        chunk = spec.attention_chunk_size  # type: ignore[attr-defined]
        return range(computed // chunk * chunk // block_tokens, end)
    if kind == "mamba":
        return range(end - 1, end)
    return range(0, end)


class Shadow:
    """What every block physically holds, tracked from allocations alone.

    An attention block at index ``j`` written by request ``r`` holds KV computed from
    ``r``'s tokens ``[0, (j + 1) * block_tokens)``; a Mamba block holds the state after the
    request's computed length at the end of the last step that wrote it.
    """

    def __init__(self, allocator: KVCacheAllocator) -> None:
        self.allocator = allocator
        self.writer: dict[tuple[int, int], list[int]] = {}
        self.tenant: dict[tuple[int, int], object] = {}
        self.state_at: dict[tuple[int, int], int] = {}

    def key(self, group: int, block: int) -> tuple[int, int]:
        return self.allocator._pool_of[group], block

    def record(self, request: Request, result: Allocated) -> None:
        allocator = self.allocator
        tables = allocator.block_ids(request.request_id)
        known = allocator.num_computed_tokens(request.request_id)
        for group, new_ids in enumerate(result.new_block_ids):
            for block in new_ids:
                self.writer[self.key(group, block)] = request.token_ids
                self.tenant[self.key(group, block)] = (request.cache_salt, request.lora_name)
                self.state_at.pop(self.key(group, block), None)
        for group, spec in enumerate(allocator.specs):
            if spec.kind != "mamba" or known == 0:
                continue
            tokens = allocator._block_tokens[group]
            index = (known - 1) // tokens
            block = tables[group][index] if index < len(tables[group]) else 0
            assert block, f"Mamba running state at {known} has no block"
            self.state_at[self.key(group, block)] = known

    def check_hit(self, request: Request, prefix: CachedPrefix) -> None:
        """Every block of the hit holds this prompt's KV, and every group has what it needs
        to resume at the hit position."""
        allocator = self.allocator
        hit = prefix.num_tokens
        tokens = request.token_ids
        assert 0 <= hit <= max(0, len(tokens) - 1)
        for group, spec in enumerate(allocator.specs):
            ids = prefix.block_ids[group]
            block_tokens = allocator._block_tokens[group]
            if allocator.admission_caps[group] == 0:
                continue
            assert hit % block_tokens == 0, (group, hit)
            assert len(ids) == hit // block_tokens, (group, len(ids), hit)
            for index, block in enumerate(ids):
                if not block:
                    continue
                writer = self.writer[self.key(group, block)]
                assert self.tenant[self.key(group, block)] == (
                    request.cache_salt,
                    request.lora_name,
                ), "a hit crossed tenants or adapters"
                end = (index + 1) * block_tokens
                assert len(writer) >= end and writer[:end] == tokens[:end], (
                    f"group {group} block {block} at index {index} holds other tokens"
                )
                if spec.kind == "mamba":
                    assert self.state_at.get(self.key(group, block)) == end, (
                        f"Mamba block {block} holds the state at "
                        f"{self.state_at.get(self.key(group, block))}, not at {end}"
                    )
            for index in needed_indices(spec, block_tokens, hit):
                assert ids[index], f"group {group} ({spec.kind}) lacks block {index} at {hit}"
        assert hit == self.best_hit(request), "a longer prefix every group can resume from exists"

    def best_hit(self, request: Request) -> int:
        """By brute force: the largest position every group has its needed blocks cached
        for (the allocator must find exactly this one)."""
        allocator = self.allocator
        holding = [g for g, cap in enumerate(allocator.admission_caps) if cap > 0]
        step = math.lcm(*(allocator._block_tokens[g] for g in holding))
        last = len(request.token_ids) - 1
        if last < allocator.hash_block_size:
            return 0
        fine = allocator._hasher.hashes(request, last)
        for position in range(last // step * step, 0, -step):
            if all(
                fine[(index + 1) * allocator._hash_stride[g] - 1] in allocator._caches[g]
                for g in holding
                for index in needed_indices(
                    allocator.specs[g], allocator._block_tokens[g], position
                )
            ):
                return position
        return 0


def admit_on_each(
    allocators: Sequence[KVCacheAllocator], op: tuple, next_id: int, running: list
) -> int:
    """Carry out ``("admit", prefix, suffix, chunk)`` on each allocator: one request of
    ``prefix + suffix`` (its own Request object per allocator: hashes are cached on it),
    a prefix lookup, then at most ``chunk`` tokens. Asserts that all allocators find the
    same hit and answer alike; appends the requests to ``running`` if admitted. Returns the
    next free request id."""
    _, prefix, suffix, chunk = op
    prompt = [*prefix, *suffix] or [0]
    requests = tuple(Request(next_id, list(prompt)) for _ in allocators)
    hits = [
        allocator.find_cached_prefix(request)
        for allocator, request in zip(allocators, requests, strict=True)
    ]
    assert all(hit == hits[0] for hit in hits)
    count = min(chunk, len(prompt) - hits[0].num_tokens)
    results = [
        allocator.allocate_slots(request, count, prefix=hit)
        for allocator, request, hit in zip(allocators, requests, hits, strict=True)
    ]
    assert all(result == results[0] for result in results)
    if results[0]:
        running.append(requests)
    return next_id + 1


def use_pure_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Turn the compiled kernels (``kvspec_core.runtime._native``) off in every module that
    takes them, so the pure-Python code they mirror runs.

    Every runtime module holding a ``native`` binding is patched, found by walking the
    package: a module that starts reading the kernels is covered without editing a list (a
    forgotten one would make the pure-Python runs silently test the kernels)."""
    kernels_built = _kernels_built()
    patched = []
    for name, module in _runtime_modules():
        if getattr(module, "native", None) is not None:
            monkeypatch.setattr(module, "native", None)
            patched.append(name)
    if kernels_built:
        # The modules that run kernels by themselves must be among them.
        missing = {"fast_paths", "hashing", "pool", "rules", "stepping"} - set(patched)
        assert not missing, f"use_pure_python did not find {sorted(missing)}"


@functools.cache
def _runtime_modules() -> tuple[tuple[str, ModuleType], ...]:
    """Every module of kvspec_core.runtime, imported (walked once per test session, not
    once per pure-Python test)."""
    import kvspec_core.runtime as runtime_package

    return tuple(
        (info.name, importlib.import_module(f"{runtime_package.__name__}.{info.name}"))
        for info in pkgutil.iter_modules(runtime_package.__path__)
    )


def _kernels_built() -> bool:
    from kvspec_core.runtime import native as native_module

    return native_module.native is not None


def machine_test_cases(machine: type, *, max_examples: int) -> tuple[type, type]:
    """The unittest cases of a hypothesis state machine, on the compiled kernels and on the
    pure-Python code they mirror (the folder's conftest cannot parametrize unittest-style
    cases): ``TestX, TestXPurePython = machine_test_cases(XMachine, max_examples=...)``."""
    from hypothesis import HealthCheck, settings

    compiled = machine.TestCase  # type: ignore[attr-defined]
    compiled.settings = settings(
        max_examples=max_examples,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )

    class PurePython(compiled):  # type: ignore[misc,valid-type]
        """The same machine over the pure-Python code."""

        def setUp(self) -> None:
            self._patch = pytest.MonkeyPatch()
            use_pure_python(self._patch)

        def tearDown(self) -> None:
            self._patch.undo()

    PurePython.__name__ = PurePython.__qualname__ = f"{machine.__name__}PurePython"
    return compiled, PurePython


#: The replay benchmark, which tests load as a module (it is a script, not a package).
REPLAY_TRACE_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "replay_trace.py"


def load_replay_trace(module_name: str) -> ModuleType:
    """``benchmarks/replay_trace.py`` loaded as a fresh module named ``module_name``."""
    return _load_script(REPLAY_TRACE_SCRIPT, module_name)


def _load_script(script: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_content_check(module_name: str) -> Iterator[ModuleType]:
    """``benchmarks/tier_content_check.py`` loaded as a fresh module named ``module_name``
    (a module fixture's body: ``yield from``). The script imports ``replay_trace`` from its
    own folder, as when run from there: that folder is on ``sys.path`` until it ends."""
    folder = str(REPLAY_TRACE_SCRIPT.parent)
    sys.path.insert(0, folder)
    try:
        yield _load_script(REPLAY_TRACE_SCRIPT.parent / "tier_content_check.py", module_name)
    finally:
        sys.path.remove(folder)


def write_forward(
    content: dict[tuple[int, int, int], tuple],
    allocator: KVCacheAllocator,
    request: Request,
    start: int,
    end: int,
) -> None:
    """What an engine's forward over tokens ``[start, end)`` of ``request`` writes, for the
    tiered state machines: ``content[(0, pool, block)] = (group, tokens it covers)`` for
    each device block it writes (a Mamba group writes only the state block where it ends)."""
    tokens_now = tuple(request.token_ids)
    for gid, table in enumerate(allocator.block_ids(request.request_id)):
        size = allocator._block_tokens[gid]
        pool = allocator._pool_of[gid]
        if allocator.specs[gid].kind == "mamba":
            index = (end - 1) // size
            if end > start and index < len(table) and table[index]:
                content[(0, pool, table[index])] = (gid, tokens_now[:end])
            continue
        for index, block in enumerate(table):
            if block and index * size < end and (index + 1) * size > start:
                covered = min((index + 1) * size, end)
                content[(0, pool, block)] = (gid, tokens_now[:covered])


def copy_transfers(
    content: dict[tuple[int, int, int], tuple],
    transfers: Sequence[Transfer],
    fail: int,
    defer: int,
    garbage: Iterator[int],
) -> tuple[list[int], list[int], list[tuple[Transfer, bool]]]:
    """Run ``transfers`` as an engine would, in order, for the tiered state machines: each
    copies the content ids of its source blocks to its destination blocks, except one that
    fails (bit ``position`` of ``fail``), which writes fresh garbage (``next(garbage)``).
    Returns the ids to confirm, the ids that failed, and the ``(transfer, ok)`` pairs left
    unconfirmed for later (bit ``position`` of ``defer``; a load is never deferred)."""
    done: list[int] = []
    failed: list[int] = []
    deferred: list[tuple[Transfer, bool]] = []
    for position, transfer in enumerate(transfers):
        failing = bool(fail >> position & 1)
        for source, destination in zip(
            transfer.source_blocks, transfer.destination_blocks, strict=True
        ):
            key = (transfer.destination_tier, transfer.pool, destination)
            if failing:
                content[key] = ("garbage", next(garbage))
            else:
                content[key] = content.get(
                    (transfer.source_tier, transfer.pool, source), ("never written",)
                )
        if defer >> position & 1 and transfer.kind != LOAD:
            deferred.append((transfer, not failing))
        elif failing:
            failed.append(transfer.transfer_id)
        else:
            done.append(transfer.transfer_id)
    return done, failed, deferred
