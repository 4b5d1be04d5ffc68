"""Refusals found by fuzzing: each is a kvspec error that says what to do, raised before the
allocator changes anything (pools, hash index, request table, events)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest
from runtime_testkit import context, full

from kvspec_core import FullAttentionSpec, PluginError, PluginManager, hookimpl
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import FullAttentionRules, KVCacheAllocator, Request


def snapshot(allocator: KVCacheAllocator) -> object:
    """Everything a refused call must leave as it was."""
    pools = [
        (
            list(pool.ref_counts),
            list(pool._fresh),
            list(pool._evictable),
            list(pool._protected),
            {gid: dict(cache) for gid, cache in pool.caches.items()},
            pool.epoch,
        )
        for pool in allocator.pools
    ]
    running = {
        rid: (allocator.block_ids(rid), allocator.num_computed_tokens(rid))
        for rid in allocator._running
    }
    return pools, running, list(allocator._events or ()), list(allocator._freed)


def admitted(allocator: KVCacheAllocator, rid: str, tokens: list[int]) -> Request:
    request = Request(rid, tokens)
    prefix = allocator.find_cached_prefix(request)
    assert allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix)
    return request


@pytest.mark.parametrize("argument", ["num_new_tokens", "lookahead"])
def test_none_counts_are_refused_naming_the_argument_and_the_fix(argument: str) -> None:
    allocator = KVCacheAllocator([full(4)], 16, context(), hash_salt=b"t", manager=PluginManager())
    request = admitted(allocator, "a", list(range(5)))
    before = snapshot(allocator)
    counts: dict[str, object] = {"num_new_tokens": 1, "lookahead": 0, argument: None}
    with pytest.raises(AllocatorError, match=rf"{argument}=None must be an int >= 0: pass"):
        allocator.allocate_slots(
            request,
            counts["num_new_tokens"],  # type: ignore[arg-type]
            counts["lookahead"],  # type: ignore[arg-type]
        )
    assert snapshot(allocator) == before


@pytest.mark.parametrize("bad_token", [-1, 2**32, "7", None])
def test_bad_token_ids_of_a_running_request_change_nothing(bad_token: object) -> None:
    allocator = KVCacheAllocator(
        [full(4), full(4)],
        32,
        context(),
        hash_salt=b"t",
        manager=PluginManager(),
        enable_kv_events=True,
    )
    admitted(allocator, "a", list(range(8)))
    allocator.free("a")
    request = admitted(allocator, "b", list(range(8)) + [50, 51])  # a hit on a's blocks
    request.token_ids.extend([52, bad_token, 53])  # type: ignore[list-item]
    before = snapshot(allocator)
    for count in (3, 2):  # fills a block (and needs a new one with 3)
        with pytest.raises(AllocatorError, match="token ids"):
            allocator.allocate_slots(request, count)
        assert snapshot(allocator) == before
    allocator.check_invariants()


def test_bad_token_ids_on_admission_with_a_hit_change_nothing() -> None:
    allocator = KVCacheAllocator(
        [full(4), full(4)],
        9,
        context(),
        hash_salt=b"t",
        manager=PluginManager(),
        enable_kv_events=True,
    )
    admitted(allocator, "a", list(range(8)))
    allocator.free("a")
    request = Request("b", list(range(8)) + [1, -5, 2, 3])
    prefix = allocator.find_cached_prefix(request)
    assert prefix.num_tokens == 8
    before = snapshot(allocator)
    with pytest.raises(AllocatorError, match="token ids"):
        allocator.allocate_slots(request, 4, prefix=prefix)
    assert snapshot(allocator) == before
    assert not allocator.is_running("b")


def test_a_freed_request_is_not_silently_readmitted() -> None:
    allocator = KVCacheAllocator([full(4)], 16, context(), hash_salt=b"t", manager=PluginManager())
    request = admitted(allocator, "a", list(range(9)))
    allocator.free("a")
    before = snapshot(allocator)
    with pytest.raises(AllocatorError, match=r"was freed.*find_cached_prefix"):
        allocator.allocate_slots(request, 1)
    assert snapshot(allocator) == before
    # Re-admission after preemption goes through find_cached_prefix, and works.
    prefix = allocator.find_cached_prefix(request)
    assert prefix.num_tokens == 8
    assert allocator.allocate_slots(request, 1, prefix=prefix)
    allocator.free("a")
    with pytest.raises(AllocatorError, match="already freed"):
        allocator.free("a")


# ----------------------------------------------------------------- plugin rules raising
@attrs.frozen(kw_only=True)
class FlakySpec(FullAttentionSpec):
    kind: ClassVar[str] = "flaky_attention"


class FlakyRules(FullAttentionRules):
    """Full attention's rules, except that ``failing`` raises once switched on."""

    failing: ClassVar[str] = ""

    def _maybe_fail(self, method: str) -> None:
        if FlakyRules.failing == method:
            raise ZeroDivisionError(f"flaky {method}")

    def skipped_tokens(self, num_computed: int) -> int:
        self._maybe_fail("skipped_tokens")
        return super().skipped_tokens(num_computed)

    def next_skip_position(self, num_skipped_blocks: int) -> int:
        self._maybe_fail("next_skip_position")
        return super().next_skip_position(num_skipped_blocks)

    def longest_hit(self, hashes, cache, max_blocks):  # type: ignore[no-untyped-def]
        self._maybe_fail("longest_hit")
        return super().longest_hit(hashes, cache, max_blocks)

    def blocks_needed(
        self, num_existing: int, num_known: int, num_total: int, num_encoder_tokens: int
    ) -> tuple[int, int]:
        self._maybe_fail("blocks_needed")
        return super().blocks_needed(num_existing, num_known, num_total, num_encoder_tokens)

    def next_allocation_end(self, num_existing: int) -> int:
        self._maybe_fail("next_allocation_end")
        return super().next_allocation_end(num_existing)

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        self._maybe_fail("cache_range")
        return super().cache_range(num_cached, num_known)


class FlakyPlugin:
    kvspec_contract_version = 1

    @hookimpl
    def kvspec_register_spec_kinds(self, register):  # type: ignore[no-untyped-def]
        register(FlakySpec)

    @hookimpl
    def kvspec_register_runtime_rules(self, register):  # type: ignore[no-untyped-def]
        register("flaky_attention", FlakyRules)


@pytest.fixture
def flaky_allocator():  # type: ignore[no-untyped-def]
    manager = PluginManager()
    manager.register(FlakyPlugin(), "flaky")
    flaky = FlakySpec(block_size=4, num_kv_heads=1, head_size=8, dtype=full(4).dtype)
    allocator = KVCacheAllocator(
        [full(4), flaky], 64, context(), manager=manager, hash_salt=b"t", enable_kv_events=True
    )
    yield allocator
    FlakyRules.failing = ""


def with_cached_prefix(allocator: KVCacheAllocator) -> None:
    """Cache the blocks of 8 tokens (two blocks per group) the requests below hit."""
    admitted(allocator, "a", list(range(8)))
    allocator.free("a")


RUN_TIME_METHODS = [
    "skipped_tokens",
    "next_skip_position",
    "blocks_needed",
    "next_allocation_end",
    "cache_range",
]


@pytest.mark.parametrize("method", RUN_TIME_METHODS)
def test_plugin_rules_raising_on_a_step_name_the_plugin_and_change_nothing(
    flaky_allocator: KVCacheAllocator, method: str
) -> None:
    with_cached_prefix(flaky_allocator)
    request = admitted(flaky_allocator, "b", list(range(8)) + [40, 41, 42])
    request.token_ids.extend([43, 44])
    FlakyRules.failing = method
    before = snapshot(flaky_allocator)
    with pytest.raises(PluginError) as caught:
        flaky_allocator.allocate_slots(request, 2)  # completes a block, needs a new one
    message = str(caught.value)
    assert "plugin 'flaky'" in message and "'flaky_attention'" in message
    assert f"ZeroDivisionError in {method}" in message and "changed nothing" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    assert snapshot(flaky_allocator) == before
    FlakyRules.failing = ""
    assert flaky_allocator.allocate_slots(request, 2)
    flaky_allocator.check_invariants()


@pytest.mark.parametrize("method", [*RUN_TIME_METHODS, "longest_hit"])
def test_plugin_rules_raising_on_admission_name_the_plugin_and_change_nothing(
    flaky_allocator: KVCacheAllocator, method: str
) -> None:
    allocator = flaky_allocator
    with_cached_prefix(allocator)
    request = Request("b", list(range(8)) + [40, 41, 42])
    FlakyRules.failing = method
    before = snapshot(allocator)
    with pytest.raises(PluginError, match=rf"plugin 'flaky'.*in {method}"):
        prefix = allocator.find_cached_prefix(request)
        allocator.allocate_slots(request, len(request.token_ids) - prefix.num_tokens, prefix=prefix)
    assert snapshot(allocator) == before
    assert not allocator.is_running("b")
