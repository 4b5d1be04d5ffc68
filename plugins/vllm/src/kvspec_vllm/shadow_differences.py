"""Why a shadow difference happened: an expected one (vLLM and kvspec follow different but
correct policies) or a real divergence that an engine builder should look at.

Two policies make vLLM 0.32 and kvspec differ on the same calls, neither giving a wrong
token (both found by driving vLLM's ``KVCacheManager`` beside kvspec's allocator; see the
README, "kvspec inside vLLM"):

* **Copies** (:data:`COPIES`). A block recomputed while its hash is cached (a hit stopped
  before it: a sliding window needs a run of cached blocks) gives two blocks of one content.
  vLLM keeps both cached and a hit takes the oldest; kvspec keeps the newest cached and frees
  the older one uncached. The requests then hold the same contents in a different number of
  physical blocks, so the free-block counts differ (and later evictions with them).
* **Sliding-window retention** (:data:`NOT_RETAINED`). With
  ``prefix_cache_retention_interval=0`` (vLLM's default) a sliding-window group caches only
  the window before a prompt's replay boundary (and shared-prefix junctions); kvspec caches
  every full block. A preempted request resumed with its output tokens, or a prompt ending
  elsewhere, then hits further in kvspec: the blocks its hit reuses hold the K/V of exactly
  those tokens (the hashes chain every token before them), the same hit vLLM itself takes
  with dense retention (``prefix_cache_retention_interval=None``).

Each verdict is checked, not assumed. A free-block difference is put down to copies only if
every mirrored request's block table has its blocks at the same positions on both sides, no
block of either side holds two different contents, both sides' free counts are exactly their
pool less the blocks of those tables, and so the whole difference is in how many physical
blocks hold the same contents. A hit difference is expected only if the two caches hold
different blocks of the request and kvspec's own rules, applied to the blocks vLLM holds,
give vLLM's hit (so the rules agree and only the contents differ). An admission difference is
expected when the free blocks or the request's hit already differed for an expected reason.
Anything else is a divergence, with what was seen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvspec_core.runtime import CachedPrefix, KVCacheAllocator, Request
from kvspec_core.runtime.coordinator import PrefixCoordinator
from kvspec_core.runtime.hashing import PrefixHasher

#: Expected: the same contents held in a different number of physical blocks.
COPIES = "copies"
#: Expected: kvspec hits blocks vLLM's sliding-window retention did not cache.
NOT_RETAINED = "not_retained"
#: Expected: the caches hold different blocks (evicted in another order since an earlier
#: expected difference), and both sides' rules agree on each.
CACHE_CONTENT = "cache_content"
#: Expected: an admission decided on free blocks or a hit that already differed.
FOLLOWS = "follows_earlier_difference"
#: Not expected: look at it.
DIVERGENCE = "divergence"

#: What each expected reason means, for logs and reports.
EXPECTED_REASONS: Mapping[str, str] = {
    COPIES: "the same contents in a different number of blocks: vLLM keeps every copy of a "
    "recomputed cached block (a hit takes the oldest), kvspec keeps the newest cached",
    NOT_RETAINED: "vLLM's sliding-window group did not cache these blocks "
    "(prefix_cache_retention_interval=0 keeps only the window before a prompt's replay "
    "boundary); kvspec caches every full block, and the hit reuses the K/V of these tokens",
    CACHE_CONTENT: "the caches hold different blocks since an earlier expected difference "
    "(another eviction order), and kvspec's rules on vLLM's blocks give vLLM's hit",
    FOLLOWS: "decided on free blocks or a hit that already differed for an expected reason",
}

#: Hashes of blocks vLLM did not retain, remembered per group; past this many, forgotten
#: (a hit on one is then put down to :data:`CACHE_CONTENT`, still expected).
MAX_REMEMBERED_UNRETAINED = 1 << 16


@attrs.frozen
class Verdict:
    """A difference's reason (a key of :data:`EXPECTED_REASONS`, or :data:`DIVERGENCE`) and
    what was seen."""

    reason: str
    detail: str

    @property
    def expected(self) -> bool:
        return self.reason != DIVERGENCE


def _divergence(detail: str) -> Verdict:
    return Verdict(DIVERGENCE, detail)


def _positions(flags: Sequence[bool]) -> list[int]:
    return [index for index, flag in enumerate(flags) if flag]


class DifferenceClassifier:
    """Classifies the differences between vLLM's ``manager`` and kvspec's ``allocator`` (one
    pool, hashing blocks of ``hash_block_size`` tokens with ``hash_salt``)."""

    def __init__(
        self,
        manager: Any,
        allocator: KVCacheAllocator,
        hash_block_size: int,
        hash_salt: bytes,
    ) -> None:
        self.manager = manager
        self.allocator = allocator
        self.hash_block_size = hash_block_size
        #: The salt of the allocator's hashes (an allocator replacing it must use it too).
        self.hash_salt = hash_salt
        self._hasher = PrefixHasher(hash_block_size, hash_salt)
        self._managers = list(manager.coordinator.single_type_managers)
        self._unretained: list[set[Any]] = [set() for _ in self._managers]
        self._checked: dict[str, int] = {}

    @property
    def comparable(self) -> bool:
        """Whether every group's blocks are hash blocks on both sides (only then are the
        tables compared position by position)."""
        size = self.hash_block_size
        return all(m.block_size == size for m in self._managers) and all(
            rules.block_tokens == size for rules in self.allocator.rules
        )

    # ----------------------------------------------------------------- hits
    def hit(self, request: Any, mirror: Request, vllm_hit: int, prefix: CachedPrefix) -> Verdict:
        """Why vLLM hit ``vllm_hit`` tokens of ``request`` and kvspec ``prefix``."""
        allocator = self.allocator
        if not allocator.enable_prefix_caching:
            return _divergence("kvspec's allocator does not cache prefixes")
        if not self.comparable:
            return _divergence("groups with blocks larger than a hash block are not compared")
        size = self.hash_block_size
        max_tokens = len(mirror.token_ids) - 1
        count = max_tokens // size
        vllm_hashes = list(request.block_hashes[:count])
        fresh = Request(mirror.request_id, list(mirror.token_ids), cache_salt=mirror.cache_salt)
        kvspec_hashes = list(self._hasher.hashes(fresh, count * size)[:count])
        pool = self.manager.block_pool
        caches = allocator.pools[0].caches
        in_vllm = [
            [pool.get_cached_block(digest, [gid]) is not None for digest in vllm_hashes]
            for gid in range(len(self._managers))
        ]
        in_kvspec = [
            [digest in caches[gid] for digest in kvspec_hashes]
            for gid in range(len(self._managers))
        ]
        if in_vllm == in_kvspec:
            return _divergence(
                "both cache the same blocks of it "
                f"({', '.join(f'group {g}: {_positions(f)}' for g, f in enumerate(in_vllm))}), "
                "so the hit rules differ"
            )
        seen = [
            {kvspec_hashes[i]: 1 for i, cached in enumerate(flags) if cached} for flags in in_vllm
        ]
        holding = [gid for gid, cap in enumerate(allocator.admission_caps) if cap > 0]
        coordinator = PrefixCoordinator(allocator.rules, holding, [1] * len(allocator.rules), seen)
        on_vllm_blocks, _, _ = coordinator.find(kvspec_hashes, max_tokens)
        if on_vllm_blocks != vllm_hit:
            return _divergence(
                f"kvspec's rules on the blocks vLLM caches give {on_vllm_blocks} tokens, vLLM "
                f"{vllm_hit}: the hit rules differ"
            )
        only_kvspec = [
            (gid, i)
            for gid in range(len(in_vllm))
            for i in range(count)
            if in_kvspec[gid][i] and not in_vllm[gid][i]
        ]
        used = [
            (gid, i)
            for gid, table in enumerate(prefix.block_ids)
            for i, block in enumerate(table)
            if block and not in_vllm[gid][i]
        ]
        where = ", ".join(f"group {gid} block {i}" for gid, i in (used or only_kvspec)[:6])
        if (
            prefix.num_tokens > vllm_hit
            and used
            and all(vllm_hashes[i] in self._unretained[gid] for gid, i in used)
        ):
            return Verdict(NOT_RETAINED, f"kvspec's hit reuses {where}, which vLLM did not cache")
        return Verdict(
            CACHE_CONTENT,
            f"kvspec caches {where or 'no block vLLM lacks'}; kvspec's rules on vLLM's blocks "
            f"give {vllm_hit} tokens",
        )

    def note_cached(self, request: Any) -> None:
        """After an ``allocate_slots`` both sides served: remember the full blocks of
        ``request`` that kvspec cached and vLLM did not (its sliding-window retention)."""
        rid = request.request_id
        allocator = self.allocator
        if not self.comparable or not allocator.is_running(rid):
            return
        hashes = request.block_hashes
        start = self._checked.get(rid, 0)
        if start >= len(hashes):
            return
        pool = allocator.pools[0]
        for gid, (manager, table) in enumerate(
            zip(self._managers, allocator.block_ids(rid), strict=True)
        ):
            vllm_table = manager.req_to_blocks.get(rid, ())
            remembered = self._unretained[gid]
            for i in range(start, min(len(hashes), len(vllm_table), len(table))):
                block = vllm_table[i]
                if (
                    not block.is_null
                    and block.block_hash is None
                    and table[i]
                    and pool.cached_hash(table[i]) is not None
                ):
                    if len(remembered) >= MAX_REMEMBERED_UNRETAINED:
                        remembered.clear()
                    remembered.add(hashes[i])
        self._checked[rid] = len(hashes)

    def forget(self, request_id: str) -> None:
        self._checked.pop(request_id, None)

    # ----------------------------------------------------------------- free blocks
    def free_blocks(
        self,
        vllm_free: int,
        kvspec_free: int,
        running: Mapping[str, Any],
        hit_differed: set[str],
        left_out: Mapping[str, tuple[Any, bool]],
    ) -> Verdict:
        """Why vLLM has ``vllm_free`` free blocks and kvspec ``kvspec_free``.

        ``running``: the mirrored requests both sides run (id -> vLLM request);
        ``hit_differed``: those admitted on a hit that differed for an expected reason;
        ``left_out``: requests vLLM runs and kvspec does not (id -> (vLLM request, whether
        they were left out for an expected reason))."""
        if not self.comparable:
            return _divergence("groups with blocks larger than a hash block are not compared")
        allocator = self.allocator
        # Per side (vLLM, kvspec): block id -> content keys of the positions it holds.
        contents: tuple[dict[int, set[Any]], dict[int, set[Any]]] = ({}, {})
        follows: list[str] = []
        held_out: list[str] = []
        vllm_rids = {rid for manager in self._managers for rid in manager.req_to_blocks}
        for rid in sorted(vllm_rids | set(running)):
            vllm_tables = [
                [
                    0 if block.is_null else block.block_id
                    for block in manager.req_to_blocks.get(rid, ())
                ]
                for manager in self._managers
            ]
            if rid in running and allocator.is_running(rid):
                kvspec_tables = allocator.block_ids(rid)
                hashes = running[rid].block_hashes
            elif any(any(table) for table in vllm_tables):
                request, expected = left_out.get(rid, (None, False))
                if request is None or not expected:
                    return _divergence(
                        f"vLLM holds blocks of request {rid!r}, which kvspec does not run "
                        + ("(left out after a divergence)" if request is not None else "")
                    )
                held_out.append(rid)
                for gid, table in enumerate(vllm_tables):
                    for i, block in enumerate(table):
                        if block:
                            contents[0].setdefault(block, set()).add(
                                _content(gid, rid, i, request.block_hashes)
                            )
                continue
            else:
                continue
            for gid, (vllm_ids, kvspec_table) in enumerate(
                zip(vllm_tables, kvspec_tables, strict=True)
            ):
                vllm_at = _positions([bool(block) for block in vllm_ids])
                kvspec_at = _positions([bool(block) for block in kvspec_table])
                if len(vllm_ids) != len(kvspec_table) or vllm_at != kvspec_at:
                    if rid in hit_differed:
                        follows.append(rid)
                        continue
                    return _divergence(
                        f"request {rid!r} group {gid}: vLLM's table of {len(vllm_ids)} holds "
                        f"blocks at positions {vllm_at}, kvspec's of {len(kvspec_table)} at "
                        f"{kvspec_at}"
                    )
                for i in kvspec_at:
                    key = _content(gid, rid, i, hashes)
                    contents[0].setdefault(vllm_ids[i], set()).add(key)
                    contents[1].setdefault(kvspec_table[i], set()).add(key)
        if follows:
            return Verdict(
                FOLLOWS,
                f"requests {follows} were admitted on a hit that differed, so their tables differ",
            )
        usable = allocator.usage.usable_blocks
        for side, name, free in ((0, "vLLM", vllm_free), (1, "kvspec", kvspec_free)):
            for block, keys in contents[side].items():
                if len(keys) > 1:
                    return _divergence(
                        f"{name}'s block {block} holds positions of different contents"
                    )
            if usable - len(contents[side]) != free:
                return _divergence(
                    f"{name} has {free} free blocks but the requests hold "
                    f"{len(contents[side])} of {usable}: blocks held outside them"
                )
        distinct = [len(set().union(*side.values())) if side else 0 for side in contents]
        copies = [len(contents[side]) - distinct[side] for side in (0, 1)]
        detail = (
            f"vLLM holds {distinct[0]} contents in {len(contents[0])} blocks ({copies[0]} "
            f"copies), kvspec {distinct[1]} in {len(contents[1])} ({copies[1]} copies)"
        )
        if held_out:
            return Verdict(
                FOLLOWS,
                f"{detail}; requests {held_out}, left out after an expected difference, hold "
                "blocks in vLLM only",
            )
        return Verdict(COPIES, detail)


def _content(gid: int, rid: str, position: int, hashes: Sequence[Any]) -> tuple[Any, ...]:
    """What block ``position`` of group ``gid`` of request ``rid`` holds: its tokens' chained
    hash when the block is full (any request with those tokens has the same content), else
    the request's own partial block."""
    return (gid, hashes[position]) if position < len(hashes) else (gid, rid, position)
