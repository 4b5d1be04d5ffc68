"""Random batched engine steps against an allocator with offload tiers, checking content:
every cached slot of every tier (and every cached device block after a clean forward)
holds exactly what its hash names.

The engine model schedules several requests per step (admissions, prefill chunks and
decodes through ``allocate_slots``, ``allocate_step`` or ``decode_step``, skips, frees,
preemptions, request ids reused), takes the transfers once per step or after each
allocation (as kvspec-transformers and the simulator do), runs them in order and confirms
them at once, later, or fails them, then runs the forward (which may fail:
``discard_uncomputed``). A forward writes ``(group, tokens of the prefix the block
covers)`` into the blocks it computes; a transfer copies what its source holds, a failed
one writes garbage. Write-back and write-through, keeping everything or what the families
say, over full attention, a tight full attention, full + sliding window and full + Mamba.
(Based on the batched machine of the issue-20 review.)
"""

from __future__ import annotations

import itertools

import hypothesis.strategies as st
from hypothesis import event
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from runtime_testkit import (
    copy_transfers,
    full,
    machine_test_cases,
    make_allocator,
    needed_indices,
    write_forward,
)
from test_tiered_state_machine import CONFIGS as TIERED_CONFIGS

from kvspec_core.runtime import NotNow, Request
from kvspec_core.runtime.tiers import (
    KEEP_EVERYTHING,
    KEEP_FAMILY_RULES,
    WRITE_BACK,
    WRITE_THROUGH,
    OffloadTier,
    TieredPrefix,
)

#: name -> (specs, device blocks per pool, pool of each group, (host, disk) slots): the
#: random tiered machine's, and a tight full attention.
CONFIGS = {**TIERED_CONFIGS, "full_small": ([full(2)], 7, None, (3, 3))}
PREFIXES = (
    [1, 2, 3, 1, 2, 3, 1, 2, 3, 4, 5, 6],
    [7, 7, 7, 7, 7, 7, 7, 7],
    [1, 2, 3, 1],
    [5, 6, 5, 6, 5, 6, 5, 6, 5],
    [8, 9, 8, 9, 9, 8, 9, 8],
    [],
)
SUFFIXES = st.lists(st.integers(0, 2), max_size=6)
#: A bit mask over a step's transfers (or scheduled requests): mostly none.
MASKS = st.sampled_from([0, 0, 0]) | st.integers(1, 63)


class ContentMachine(RuleBasedStateMachine):
    @initialize(
        name=st.sampled_from(sorted(CONFIGS)),
        eviction=st.sampled_from(["lru", "segmented"]),
        write_policy=st.sampled_from([WRITE_BACK, WRITE_THROUGH, WRITE_THROUGH]),
        keep=st.sampled_from([KEEP_EVERYTHING, KEEP_FAMILY_RULES]),
    )
    def build(self, name, eviction, write_policy, keep):
        specs, blocks, pools, (host, disk) = CONFIGS[name]
        self.allocator = make_allocator(
            specs,
            blocks,
            pools,
            offload_tiers=(
                OffloadTier("host", host, eviction, write_policy, keep),
                OffloadTier("disk", disk),
            ),
        )
        #: (tier, pool, block) -> what it holds.
        self.content: dict[tuple[int, int, int], tuple] = {}
        self.deferred: list[tuple[object, bool]] = []
        self.requests: dict[int, list] = {}  # id -> [Request, prompt tokens left]
        self.next_id = 0
        self.garbage = itertools.count(1)  # ids of what a failed copy writes
        self.tokens_of: dict[bytes, tuple[int, ...]] = {}
        self.freed_ids: list[int] = []

    def _pool(self, gid):
        return self.allocator._pool_of[gid]

    def _learn(self, request):
        """Remember the tokens each of ``request``'s block hashes names."""
        hasher = self.allocator._hasher
        probe = Request("probe", list(request.token_ids))
        size = hasher.hash_block_size
        for index, digest in enumerate(hasher.hashes(probe, len(probe.token_ids))):
            self.tokens_of[digest] = tuple(probe.token_ids[: (index + 1) * size])

    def _forward(self, request: Request, start: int, end: int) -> None:
        """Write what a forward over tokens ``[start, end)`` writes."""
        write_forward(self.content, self.allocator, request, start, end)

    def _run_transfers(self, fail=0, defer=0):
        """Take the transfers and run them in order; returns the requests to drop."""
        done, failed, deferred = copy_transfers(
            self.content, self.allocator.take_transfers(), fail, defer, self.garbage
        )
        self.deferred.extend(deferred)
        self.allocator.complete_transfers(done, ok=True)
        dropped = set(self.allocator.complete_transfers(failed, ok=False))
        self._check_tiers("after transfers")
        return dropped

    def _discard(self, rid, start):
        """A failed forward: the request and, as ``discard_uncomputed`` reports them, those
        that reused blocks it never wrote (later in the step's order: they leave it too)."""
        reusers = {rid: start}
        while reusers:
            rid, start = reusers.popitem()
            if not self.allocator.is_running(rid):
                continue
            for other, position in self.allocator.discard_uncomputed(rid, start).items():
                event("a reuser of blocks a failed forward never wrote")
                reusers[other] = min(position, reusers.get(other, position))
            self.requests.pop(rid, None)
            self.freed_ids.append(rid)

    def _check_tiers(self, where):
        for tier, row in enumerate(self.allocator._tiers.tier_pools, start=1):
            for pool, slots in enumerate(row):
                if slots is None:
                    continue
                for gid, cache in slots.caches.items():
                    for digest, slot in cache.items():
                        want = (gid, self.tokens_of.get(digest, ("unknown hash",)))
                        got = self.content.get((tier, pool, slot))
                        assert got == want, (
                            f"{where}: tier {tier} pool {pool} slot {slot} (group {gid}) "
                            f"holds {got}, its hash names {want}"
                        )

    def _check_reads(self, request: Request, start: int) -> None:
        """The blocks ``request`` reads to resume at ``start`` hold its own content, once the
        step's forward wrote what it computes (a request admitted in the step may read
        blocks another request of the step computes: a batch writes its K/V before it
        attends). A Mamba state is checked where a step ended on a block boundary."""
        allocator = self.allocator
        tokens = tuple(request.token_ids)
        for gid, table in enumerate(allocator.block_ids(request.request_id)):
            spec, size = allocator.specs[gid], allocator._block_tokens[gid]
            if spec.kind == "mamba" and start % size:
                continue
            for index in needed_indices(spec, size, start):
                covered = start if spec.kind == "mamba" else (index + 1) * size
                got = self.content.get((0, self._pool(gid), table[index])) if table[index] else None
                assert got == (gid, tokens[:covered]), (
                    f"request {request.request_id!r} resuming at {start} reads block "
                    f"{table[index]} (group {gid}, index {index}) holding {got}, not its own "
                    f"{covered} tokens"
                )

    def _check_device(self, where):
        for gid, cache in enumerate(self.allocator._caches):
            pool = self._pool(gid)
            for digest, block in cache.items():
                want = (gid, self.tokens_of.get(digest, ("unknown hash",)))
                got = self.content.get((0, pool, block))
                assert got == want, (
                    f"{where}: device pool {pool} block {block} (group {gid}) holds {got}, "
                    f"its hash names {want}"
                )

    @rule(
        new=st.lists(
            st.tuples(st.sampled_from(PREFIXES), SUFFIXES, st.integers(1, 8), st.booleans()),
            max_size=2,
        ),
        plan=st.lists(
            st.tuples(
                st.sampled_from(["go", "go", "go", "skip", "free", "preempt"]),
                st.integers(1, 8),
                st.integers(0, 2),
            ),
            max_size=4,
        ),
        fail=MASKS,
        defer=MASKS,
        forward_fails=st.sampled_from([0] * 6) | st.integers(1, 15),
        use_batch=st.booleans(),
        take_each=st.booleans(),
    )
    def engine_step(self, new, plan, fail, defer, forward_fails, use_batch, take_each):
        allocator = self.allocator
        dropped: set = set()

        def after_allocation():
            # An engine that runs the transfers after each allocation (all confirmed).
            if take_each:
                dropped.update(self._run_transfers())

        sampled: dict[int, int] = {}
        scheduled = []  # (request, start, count, admitted prefix or None)
        batch = []  # (request, count, start, is a decode)
        for (action, size, token), rid in zip(plan, list(self.requests), strict=False):
            request, left = self.requests[rid]
            if action in ("free", "preempt"):
                allocator.free(rid)
                del self.requests[rid]
                self.freed_ids.append(rid)
                continue
            if action == "skip":
                continue
            if left:
                count = min(size, left)
            else:
                request.append_token(token)
                sampled[rid] = token
                count = 1
            start = allocator.num_computed_tokens(rid)
            if use_batch:
                batch.append((request, count, start, not left))
                continue
            if isinstance(allocator.allocate_slots(request, count), NotNow):
                if not left:
                    request.token_ids.pop()
                continue
            self._learn(request)
            scheduled.append((request, start, count, None))
            after_allocation()
        if batch:
            if all(decode for *_, decode in batch):
                event("decode_step")
                for request, *_ in batch:
                    request.token_ids.pop()  # decode_step appends it
                results = allocator.decode_step(
                    [b[0].request_id for b in batch], [sampled[b[0].request_id] for b in batch]
                )
            else:
                event("allocate_step")
                results = allocator.allocate_step([(b[0], b[1]) for b in batch])
            for (request, count, start, decode), result in zip(batch, results, strict=True):
                if isinstance(result, NotNow):
                    if decode:
                        request.token_ids.pop()
                    continue
                self._learn(request)
                scheduled.append((request, start, count, None))
            after_allocation()
        for prefix, suffix, chunk, reuse in new:
            prompt = list(prefix) + suffix or [0]
            if reuse and self.freed_ids:
                rid = self.freed_ids.pop(0)
                event("request id reused")
            else:
                rid = self.next_id
                self.next_id += 1
            if allocator.is_running(rid):
                continue
            request = Request(rid, prompt)
            self._learn(request)
            found = allocator.find_cached_prefix(request)
            count = min(chunk, len(prompt) - found.num_tokens)
            if isinstance(allocator.allocate_slots(request, count, prefix=found), NotNow):
                continue
            if isinstance(found, TieredPrefix):
                event("tier hit")
            self.requests[rid] = [request, len(prompt) - found.num_tokens - count]
            scheduled.append((request, found.num_tokens, count, found))
            after_allocation()
        dropped |= self._run_transfers(fail, defer)
        any_failed = False
        ran = []
        for index, (request, start, count, found) in enumerate(scheduled):
            rid = request.request_id
            if rid in dropped or not allocator.is_running(rid):
                self.requests.pop(rid, None)
                continue
            if forward_fails >> index & 1:
                any_failed = True
                event("forward failed")
                self._discard(rid, start)
                continue
            self._forward(request, start, start + count)
            ran.append((request, start))
            left = self.requests[rid][1]
            if found is None and left:
                self.requests[rid][1] = left - count
        if not any_failed:
            # (A forward that failed alone left blocks unwritten that others of the step may
            # read: an engine's batch fails as a whole.)
            for request, start in ran:
                self._check_reads(request, start)
            self._check_device("after the forward")
        self._check_tiers("after the forward")

    @rule(dice=st.integers(0, 3))
    def confirm_deferred(self, dice):
        if self.deferred:
            transfer, ok = self.deferred.pop(dice % len(self.deferred))
            self.allocator.complete_transfers([transfer.transfer_id], ok=ok)
            self._check_tiers("after a deferred completion")

    @rule(dice=st.integers(0, 9))
    def reset_cache(self, dice):
        if dice == 0:
            self.allocator.reset_prefix_cache()

    @invariant()
    def consistent(self):
        if hasattr(self, "allocator"):
            self.allocator.check_invariants()

    def teardown(self):
        if not hasattr(self, "allocator"):
            return
        for transfer, ok in self.deferred:
            self.allocator.complete_transfers([transfer.transfer_id], ok=ok)
        self._check_tiers("teardown")
        for rid in list(self.allocator._running):
            self.allocator.free(rid)
        self.allocator.check_invariants()
        assert self.allocator._tiers.num_pending() == 0
        assert self.allocator.usage.used_blocks == 0


TestContentMachine, TestContentMachinePurePython = machine_test_cases(
    ContentMachine, max_examples=150
)
