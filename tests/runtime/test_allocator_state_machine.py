"""Random traces against the allocator, checked by an independent shadow model.

Invariants after every step: ref counts match the block tables and are never negative,
every free block is free exactly once (``check_invariants``). Every reported hit holds the
prompt's own tokens and gives each group what its family needs to resume (``Shadow``).
A "not now" changes nothing. At the end, after every request is freed, no block is in use.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import event
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)
from runtime_testkit import (
    Shadow,
    chunked,
    full,
    live_indices,
    machine_test_cases,
    make_allocator,
    mamba,
    sliding,
)

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import NotNow, Request

#: (specs, blocks per pool, pool of each group): full attention alone and hybrids.
CONFIGS = {
    "full": ([full(2)], 24, None),
    "full+sliding": ([full(2), sliding(2, 5)], 40, None),
    "full+mamba": ([full(4), mamba(4)], [20, 12], [0, 1]),
    "full+chunked": ([full(2), chunked(2, 6)], 40, None),
    "mixed sizes": ([full(4), sliding(2, 7), mamba(8)], [40, 12], [0, 0, 1]),
    "sliding+chunked+mamba": ([sliding(2, 3), chunked(2, 4), mamba(2)], [30, 16], [0, 0, 1]),
}

PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5, 6], [7, 7, 7, 7, 7, 7, 7, 7], [1, 2, 3, 1])
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=24)


class AllocatorMachine(RuleBasedStateMachine):
    running = Bundle("running")

    @initialize(
        name=st.sampled_from(sorted(CONFIGS)), eviction=st.sampled_from(["segmented", "lru"])
    )
    def build(self, name: str, eviction: str) -> None:
        specs, blocks, pools = CONFIGS[name]
        self.name = name
        self.allocator = make_allocator(specs, blocks, pools, eviction=eviction)
        self.shadow = Shadow(self.allocator)
        self.prefill_left: dict[int, int] = {}
        self.next_id = 0
        self.limit = self.allocator.ctx.max_in_flight_tokens

    def _snapshot(self, request_id: int | None) -> tuple:
        usage = self.allocator.usage
        tables = (
            self.allocator.block_ids(request_id)
            if request_id is not None and self.allocator.is_running(request_id)
            else None
        )
        return usage, tables

    @rule(
        target=running,
        prefix=st.sampled_from(PREFIXES + ([],)),
        suffix=tokens,
        first_chunk=st.integers(1, 8),
        tenant=st.sampled_from([None, None, "t1"]),
        split=st.booleans(),
    )
    def admit(
        self,
        prefix: list[int],
        suffix: list[int],
        first_chunk: int,
        tenant: str | None,
        split: bool,
    ):
        prompt = list(prefix) + suffix
        if not prompt:
            prompt = [0]
        request = Request(self.next_id, prompt, cache_salt=tenant)
        self.next_id += 1
        found = self.allocator.find_cached_prefix(request)
        self.shadow.check_hit(request, found)
        event(f"{self.name}: prefix hit {'yes' if found.num_tokens else 'no'}")
        chunk = min(first_chunk, len(prompt) - found.num_tokens)
        if split and found.checkpoint_at is not None:
            # End the first step where the allocator says a state checkpoint pays off.
            event("split at checkpoint_at")
            chunk = found.checkpoint_at - found.num_tokens
        before = self._snapshot(None)
        result = self.allocator.allocate_slots(request, chunk, prefix=found)
        if isinstance(result, NotNow):
            event(f"admission not now: {result.reason}")
            assert self._snapshot(None) == before
            assert not self.allocator.is_running(request.request_id)
            return multiple()
        self.shadow.record(request, result)
        self.prefill_left[request.request_id] = len(prompt) - found.num_tokens - chunk
        return request

    @rule(
        request=running,
        size=st.integers(1, 8),
        token=st.integers(0, 2),
        lookahead=st.integers(0, 1),
    )
    def step(self, request: Request, size: int, token: int, lookahead: int) -> None:
        rid = request.request_id
        if not self.allocator.is_running(rid):
            return
        left = self.prefill_left[rid]
        if left:
            count = min(size, left)
        else:
            request.append_token(token)
            count = 1
        before = self._snapshot(rid)
        result = self.allocator.allocate_slots(request, count, lookahead=lookahead)
        if isinstance(result, NotNow):
            event(f"step not now: {result.reason}")
            assert self._snapshot(rid) == before
            if not left:
                request.token_ids.pop()  # the engine would retry this token later
            return
        self.prefill_left[rid] = left - count if left else 0
        self.shadow.record(request, result)

    @rule(request=consumes(running))
    def finish(self, request: Request) -> None:
        rid = request.request_id
        if not self.allocator.is_running(rid):
            return
        self.allocator.free(rid)
        with pytest.raises(AllocatorError, match="already freed"):
            self.allocator.free(rid)

    @rule(dice=st.integers(0, 5))
    def reset_cache(self, dice: int) -> None:
        if dice == 0:  # rarely, so that hits stay common
            self.allocator.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "allocator"):
            return
        allocator = self.allocator
        allocator.check_invariants()
        for rid in allocator._running:
            computed = allocator.num_computed_tokens(rid)
            for group, table in enumerate(allocator.block_ids(rid)):
                spec = allocator.specs[group]
                # Never more than the planner's cap, never a block the next step needs freed.
                assert sum(1 for block in table if block) <= allocator.admission_caps[group]
                for index in live_indices(spec, allocator._block_tokens[group], computed):
                    assert table[index], f"request {rid} lost block {index} of group {group}"

    def teardown(self) -> None:
        if not hasattr(self, "allocator"):
            return
        for rid in list(self.allocator._running):
            self.allocator.free(rid)
        self.allocator.check_invariants()
        usage = self.allocator.usage
        assert usage.used_blocks == 0, f"{usage.used_blocks} blocks leaked"
        assert usage.free_blocks == usage.usable_blocks


TestAllocatorMachine, TestAllocatorMachinePurePython = machine_test_cases(
    AllocatorMachine, max_examples=400
)
