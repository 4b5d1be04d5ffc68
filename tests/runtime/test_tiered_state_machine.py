"""Random traces against an allocator with offload tiers, with an engine model that moves
content ids through the transfers.

Every block and tier slot holds a content id: what the engine model wrote there. A forward
writes ``(group, tokens of the prefix it covers)`` into the blocks it computes; a transfer
copies ids (a failed one writes garbage). After every admission, each block a family needs
to resume from the hit holds exactly the content of the request's own prefix there,
whichever tier it came from: no false hit across tiers. Transfers are confirmed at once,
later, or failed; a destination in flight is never named by a lookup, never evicted
(``check_invariants`` checks the tiers' references against the transfers in flight).
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
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
    copy_transfers,
    full,
    machine_test_cases,
    make_allocator,
    mamba,
    needed_indices,
    sliding,
    write_forward,
)

from kvspec_core.runtime import NotNow, Request
from kvspec_core.runtime.tiers import (
    KEEP_EVERYTHING,
    KEEP_FAMILY_RULES,
    WRITE_BACK,
    WRITE_THROUGH,
    OffloadTier,
    TieredPrefix,
    Transfer,
)

#: (specs, device blocks per pool, pool of each group, tier blocks per pool).
CONFIGS = {
    "full": ([full(2)], 10, None, (4, 6)),
    "full+sliding": ([full(2), sliding(2, 5)], 16, None, (6, 8)),
    "full+mamba": ([full(4), mamba(4)], [10, 8], [0, 1], ((4, 4), (6, 0))),
}

#: Prompts' shared beginnings: more of them than the device keeps, so they move to the tiers.
PREFIXES = (
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5, 6],
    [7, 7, 7, 7, 7, 7, 7, 7],
    [1, 2, 3, 1],
    [5, 6, 5, 6, 5, 6, 5, 6, 5],
    [8, 9, 8, 9, 9, 8, 9, 8],
    [4, 4, 3, 3, 2, 2, 1, 1],
)
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=6)


class TieredMachine(RuleBasedStateMachine):
    running = Bundle("running")

    @initialize(
        name=st.sampled_from(sorted(CONFIGS)),
        eviction=st.sampled_from(["lru", "segmented"]),
        write_policy=st.sampled_from([WRITE_BACK, WRITE_THROUGH]),
        keep=st.sampled_from([KEEP_EVERYTHING, KEEP_FAMILY_RULES]),
    )
    def build(self, name: str, eviction: str, write_policy: str, keep: str) -> None:
        specs, blocks, pools, (host, disk) = CONFIGS[name]
        self.name = name
        self.allocator = make_allocator(
            specs,
            blocks,
            pools,
            offload_tiers=(
                OffloadTier("host", host, eviction, write_policy, keep),
                OffloadTier("disk", disk),
            ),
        )
        event(f"write policy {write_policy}, keep {keep}")
        # (tier, pool, block) -> content id; tier 0 is the device.
        self.content: dict[tuple[int, int, int], object] = {}
        self.deferred: list[tuple[Transfer, bool]] = []
        self.prefill_left: dict[int, int] = {}
        self.next_id = 0
        self.garbage = itertools.count(1)  # ids of what a failed copy writes

    # ----------------------------------------------------------------- the engine model
    def _pool(self, gid: int) -> int:
        return self.allocator._pool_of[gid]

    def _forward(self, request: Request, start: int, end: int) -> None:
        """Write what a forward over tokens ``[start, end)`` writes."""
        write_forward(self.content, self.allocator, request, start, end)

    def _run_transfers(self, fail: int, defer: int) -> None:
        """Copy content ids as the engine would, in order, before the forward; confirm,
        defer or fail some (``fail`` / ``defer``: bit masks over the transfers)."""
        now_ok, now_failed, deferred = copy_transfers(
            self.content, self.allocator.take_transfers(), fail, defer, self.garbage
        )
        for pair in deferred:
            self.deferred.append(pair)
            event("transfer deferred")
        self.allocator.complete_transfers(now_ok, ok=True)
        dropped = self.allocator.complete_transfers(now_failed, ok=False)
        for rid in dropped:
            event("a failed load dropped its request")
            assert not self.allocator.is_running(rid)

    def _check_hit(self, request: Request, found) -> None:
        """Each block the families need at the hit holds the request's own content."""
        allocator = self.allocator
        hit = found.num_tokens
        if isinstance(found, TieredPrefix):
            event(f"{self.name}: tier hit")
            assert sum(found.tokens_by_tier) == hit
        tables = allocator.block_ids(request.request_id)
        for gid, table in enumerate(tables):
            if gid not in allocator._holding:
                continue
            size = allocator._block_tokens[gid]
            for index in needed_indices(allocator.specs[gid], size, hit):
                block = table[index]
                assert block, f"group {gid} has no block at needed position {index}"
                expected = (gid, tuple(request.token_ids[: (index + 1) * size]))
                got = self.content.get((0, self._pool(gid), block))
                assert got == expected, (
                    f"false hit: group {gid} block {block} at {index} holds {got}, "
                    f"expected {expected}"
                )

    def _pending_destinations(self) -> set[tuple[int, int, int]]:
        tiers = self.allocator._tiers
        return {
            (pending.destination_tier, pending.pool, block)
            for pending in tiers._pending.values()
            for block in pending.destination
        }

    # ----------------------------------------------------------------- rules
    @rule(
        target=running,
        prefix=st.sampled_from(PREFIXES + ([],)),
        suffix=tokens,
        first_chunk=st.integers(1, 8),
        fail=st.sampled_from([0, 0, 0]) | st.integers(1, 63),
        defer=st.sampled_from([0, 0, 0]) | st.integers(1, 63),
    )
    def admit(self, prefix, suffix, first_chunk, fail, defer):
        prompt = list(prefix) + suffix or [0]
        running = list(self.allocator._running)
        if len(running) > 2:
            # Requests finish, so the device evicts and the tiers fill.
            self.allocator.free(running[0])
        request = Request(self.next_id, prompt)
        self.next_id += 1
        found = self.allocator.find_cached_prefix(request)
        pending = self._pending_destinations()
        for gid, ids in enumerate(found.block_ids):
            for block in ids:
                assert not block or (0, self._pool(gid), block) not in pending
        if isinstance(found, TieredPrefix):
            for gid, loads in enumerate(found.loads):
                for _, tier, slot in loads:
                    assert (tier, self._pool(gid), slot) not in pending
        chunk = min(first_chunk, len(prompt) - found.num_tokens)
        result = self.allocator.allocate_slots(request, chunk, prefix=found)
        if isinstance(result, NotNow):
            event(f"admission not now: {result.reason}")
            assert not self.allocator.is_running(request.request_id)
            self._run_transfers(0, 0)
            return multiple()
        self._run_transfers(fail, defer)
        if not self.allocator.is_running(request.request_id):
            return multiple()  # its load failed: the engine drops it from the step
        self._check_hit(request, found)
        self._forward(request, found.num_tokens, found.num_tokens + chunk)
        self.prefill_left[request.request_id] = len(prompt) - found.num_tokens - chunk
        return request

    @rule(
        request=running,
        size=st.integers(1, 8),
        token=st.integers(0, 2),
        forward_fails=st.sampled_from([False] * 7 + [True]),
    )
    def step(self, request: Request, size: int, token: int, forward_fails: bool) -> None:
        rid = request.request_id
        if not self.allocator.is_running(rid):
            return
        left = self.prefill_left[rid]
        if left:
            count = min(size, left)
        else:
            request.append_token(token)
            count = 1
        start = self.allocator.num_computed_tokens(rid)
        result = self.allocator.allocate_slots(request, count)
        if isinstance(result, NotNow):
            if not left:
                request.token_ids.pop()
            self._run_transfers(0, 0)
            return
        self._run_transfers(0, 0)
        if forward_fails:
            # Nothing of the step was written: the engine discards the request from there.
            event("a forward failed")
            self.allocator.discard_uncomputed(rid, start)
            return
        self.prefill_left[rid] = left - count if left else 0
        self._forward(request, start, start + count)

    @rule(request=consumes(running))
    def finish(self, request: Request) -> None:
        if self.allocator.is_running(request.request_id):
            self.allocator.free(request.request_id)

    @rule(dice=st.integers(0, 3))
    def confirm_deferred(self, dice: int) -> None:
        if not self.deferred:
            return
        transfer, ok = self.deferred.pop(dice % len(self.deferred))
        self.allocator.complete_transfers([transfer.transfer_id], ok=ok)

    @rule(dice=st.integers(0, 7))
    def reset_cache(self, dice: int) -> None:
        if dice == 0:
            self.allocator.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "allocator"):
            self.allocator.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "allocator"):
            return
        for transfer, ok in self.deferred:
            self.allocator.complete_transfers([transfer.transfer_id], ok=ok)
        for rid in list(self.allocator._running):
            self.allocator.free(rid)
        self.allocator.check_invariants()
        assert self.allocator._tiers.num_pending() == 0
        usage = self.allocator.usage
        assert usage.used_blocks == 0, f"{usage.used_blocks} blocks leaked"


TestTieredMachine, TestTieredMachinePurePython = machine_test_cases(TieredMachine, max_examples=300)
