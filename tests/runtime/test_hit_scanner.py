"""The allocator asks each group for its hit through ``hit_scanner``: the compiled twin of
full attention's prefix scan where a group keeps that scan, the group's own ``longest_hit``
everywhere else. A scanner that ignored a plugin's override would be a silent false hit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvspec_core import (
    FullAttentionSpec,
    KVSpec,
    PluginManager,
    RegisterRuntimeRules,
    RegisterSpecKind,
    SizingContext,
    hookimpl,
)
from kvspec_core.errors import AllocatorError
from kvspec_core.plugins.core_rules import FullAttentionRules
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.rules import compiled_shape, hit_scanner

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
CTX = SizingContext(max_model_len=1024)


class FirstBlockOnly(FullAttentionRules):
    """A plugin's rules that resume from at most the first cached block."""

    def longest_hit(
        self, hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
    ) -> list[int]:
        return super().longest_hit(hashes, cache, min(max_blocks, 1))


def digests(count: int) -> list[bytes]:
    return [bytes([index]) * 8 for index in range(count)]


@given(
    # None: the cache maps the hash to None (a miss, as ``cache.get`` reads it).
    cached=st.lists(st.sampled_from([True, False, None]), max_size=12),
    # Negative (slice semantics, from the end) and beyond any index: found by review, the
    # compiled scan answered [] and OverflowError where the rules slice.
    max_blocks=st.integers(min_value=-14, max_value=14) | st.sampled_from([2**70, -(2**70)]),
)
def test_scanner_answers_what_the_rules_answer(cached: list[bool | None], max_blocks: int) -> None:
    hashes = digests(len(cached))
    cache = {
        digest: None if hit is None else 100 + index
        for index, (digest, hit) in enumerate(zip(hashes, cached, strict=True))
        if hit is not False
    }
    rules = FullAttentionRules(SPEC, CTX)
    expected = rules.longest_hit(hashes, cache, max_blocks)
    assert hit_scanner(rules)(hashes, cache, max_blocks) == expected
    # Not a list / not a dict: the Python scan, same answer.
    assert hit_scanner(rules)(tuple(hashes), dict(cache), max_blocks) == expected


def test_an_override_set_on_the_instance_is_asked() -> None:
    # A rules factory may set longest_hit on the object it returns; the compiled scan must
    # not answer for it (review of issue 19: it did, a false hit on the kernels only).
    hashes = digests(5)
    cache = {digest: 7 + index for index, digest in enumerate(hashes)}
    rules = FullAttentionRules(SPEC, CTX)
    scanner = hit_scanner(rules)
    rules.longest_hit = lambda hashes, cache, max_blocks: []  # type: ignore[method-assign]
    assert scanner(hashes, cache, 5) == []


def test_an_override_made_on_the_class_after_construction_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashes = digests(5)
    cache = {digest: 7 + index for index, digest in enumerate(hashes)}
    rules = FirstBlockOnly(SPEC, CTX)
    scanner = hit_scanner(rules)
    monkeypatch.setattr(FirstBlockOnly, "longest_hit", lambda self, h, c, m: [1, 2])
    assert scanner(hashes, cache, 5) == [1, 2]


class BrokenCacheability(FullAttentionRules):
    """A plugin's rules whose prefix_cacheable property raises."""

    @property  # type: ignore[override]
    def prefix_cacheable(self) -> bool:
        raise RuntimeError("broken property")

    @prefix_cacheable.setter
    def prefix_cacheable(self, value: bool) -> None:
        pass


def test_a_raising_property_raises_from_inside_the_scan_on_both_paths() -> None:
    scanner = hit_scanner(BrokenCacheability(SPEC, CTX))
    with pytest.raises(RuntimeError, match="broken property") as caught:
        scanner(digests(2), {}, 2)
    frames = [entry.name for entry in caught.traceback]
    assert "longest_hit" in frames[frames.index("longest_hit") :]
    # The scan of the rules object itself is among the frames, as in the Python path.
    assert any(
        entry.name == "longest_hit" and entry.frame.f_locals.get("self") is not None
        for entry in caught.traceback
    )


def test_an_overridden_scan_is_asked_not_bypassed() -> None:
    hashes = digests(5)
    cache = {digest: 7 + index for index, digest in enumerate(hashes)}
    assert hit_scanner(FirstBlockOnly(SPEC, CTX))(hashes, cache, 5) == [7]
    assert hit_scanner(FullAttentionRules(SPEC, CTX))(hashes, cache, 5) == [7, 8, 9, 10, 11]


def test_rules_that_stop_caching_after_construction_hit_nothing() -> None:
    hashes = digests(3)
    cache = {digest: 1 + index for index, digest in enumerate(hashes)}
    rules = FullAttentionRules(SPEC, CTX)
    scanner = hit_scanner(rules)
    rules.prefix_cacheable = False
    assert scanner(hashes, cache, 3) == []


@attrs.frozen(kw_only=True)
class NoResumeSpec(FullAttentionSpec):
    kind: ClassVar[str] = "no_resume_attention"


class NoResumePlugin:
    """Its rules factory adapts the core's full-attention rules on the instance: this family
    never resumes from a cached prefix, and never frees a block early either way."""

    kvspec_contract_version = 1

    @staticmethod
    def rules(spec: KVSpec, ctx: SizingContext) -> FullAttentionRules:
        rules = FullAttentionRules(spec, ctx)
        rules.longest_hit = lambda hashes, cache, max_blocks: []  # type: ignore[method-assign]
        return rules

    @hookimpl
    def kvspec_register_spec_kinds(self, register: RegisterSpecKind) -> None:
        register(NoResumeSpec)

    @hookimpl
    def kvspec_register_runtime_rules(self, register: RegisterRuntimeRules) -> None:
        register("no_resume_attention", self.rules)


def test_rules_adapted_on_the_instance_are_not_answered_by_the_compiled_lookup() -> None:
    # One full-attention group takes the compiled lookup (find.c) and steps; they run the
    # class's code, so an instance carrying its own longest_hit must keep them off (before
    # this, the compiled lookup returned the cached prefix the plugin refuses).
    manager = PluginManager()
    manager.register(NoResumePlugin(), "no_resume")
    spec = NoResumeSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    ctx = SizingContext(max_model_len=64, max_in_flight_tokens=16)
    allocator = KVCacheAllocator([spec], 32, ctx, manager=manager)
    first = Request("a", list(range(9)))
    assert allocator.allocate_slots(first, 9, prefix=allocator.find_cached_prefix(first))
    allocator.free("a")
    again = allocator.find_cached_prefix(Request("b", list(range(9))))
    assert again.num_tokens == 0
    allocator.check_invariants()


def test_instance_overrides_keep_a_group_off_the_compiled_shapes() -> None:
    rules = FullAttentionRules(SPEC, CTX)
    assert compiled_shape(rules) == 0
    rules.blocks_needed = lambda *args: (0, 0)  # type: ignore[method-assign]
    assert compiled_shape(rules) is None


class PromptOnlyPlugin(NoResumePlugin):
    """Its rules factory marks the core's full-attention rules ``caches_prompt_only`` on the
    instance (``flag``) instead: only blocks inside a request's prompt may be hits."""

    def __init__(self, flag: object) -> None:
        self.flag = flag

    def rules(self, spec: KVSpec, ctx: SizingContext) -> FullAttentionRules:  # type: ignore[override]
        rules = FullAttentionRules(spec, ctx)
        rules.caches_prompt_only = self.flag  # type: ignore[attr-defined]
        return rules


def prompt_only_allocator(flag: object) -> KVCacheAllocator:
    manager = PluginManager()
    manager.register(PromptOnlyPlugin(flag), "prompt_only")
    spec = NoResumeSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=torch.float16)
    ctx = SizingContext(max_model_len=64, max_in_flight_tokens=16)
    return KVCacheAllocator([spec], 32, ctx, manager=manager)


def test_prompt_only_rules_cache_no_block_past_the_prompt() -> None:
    # The compiled steps cache every full block: a prompt-only group stays off them.
    allocator = prompt_only_allocator(True)
    assert compiled_shape(allocator.rules[0]) is None
    request = Request("a", list(range(1, 7)))  # prompt 6: block 0 inside it
    assert allocator.allocate_slots(request, 6)
    for token in range(100, 112):
        request.append_token(token)
        assert allocator.allocate_slots(request, 1)
    allocator.free("a")
    assert allocator.usage.cached_blocks == 1
    follow_up = Request("b", [*request.token_ids, 5])
    assert allocator.find_cached_prefix(follow_up).num_tokens == 4
    allocator.check_invariants()


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_prompt_only_flag_that_is_not_a_bool_is_refused(flag: object) -> None:
    with pytest.raises(AllocatorError, match="caches_prompt_only="):
        prompt_only_allocator(flag)
