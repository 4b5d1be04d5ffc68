"""The hybrid coordinator: the longest prefix EVERY group of a model can resume from.

Each group's rules answer "the largest position <= p I can resume from" (full attention:
every block before it; sliding window: the window's blocks before it; chunked local: the
current chunk's; Mamba: a state saved exactly there). Asking the groups in turn, each at
most the current answer, until none lowers it reaches the largest position all agree on (a
fixed point): the answer never includes a position some group cannot resume from.

Groups that resume from any cached block are asked first; their common answer is where the
prompt shares cached content with earlier prompts. State groups (Mamba) that resume only
from saved checkpoints may lower it further; the difference is reported so an engine can
end a prefill step there and save a checkpoint for the requests that follow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime.rules import FamilyRules, HitScan, hit_scanner


class PrefixCoordinator:
    """Fixed-point hit search over the block-holding groups of one allocator.

    Args:
        rules: every group's rules (indexed by group id).
        holding: ids of the groups that hold blocks (the others never constrain a hit).
        hash_strides: per group, hash blocks per group block.
        caches: per group, the prefix-cache map (hash -> block id).
    """

    def __init__(
        self,
        rules: Sequence[FamilyRules],
        holding: Sequence[int],
        hash_strides: Sequence[int],
        caches: Sequence[Mapping[bytes, int]],
    ) -> None:
        self.rules = list(rules)
        self.hit_scans = [hit_scanner(group) for group in rules]
        self.block_tokens = [group.block_tokens for group in rules]
        self.hash_strides = list(hash_strides)
        self.caches = list(caches)
        self.order = sorted(holding, key=lambda gid: self.rules[gid].hit_priority)
        self.state_groups = [
            gid for gid in self.order if getattr(self.rules[gid], "resumes_at_checkpoints", False)
        ]
        self.positional_order = [gid for gid in self.order if gid not in self.state_groups]
        self.common_block_tokens = (
            math.lcm(*(self.block_tokens[gid] for gid in holding)) if holding else 1
        )

    def find(
        self,
        hashes: Sequence[bytes],
        max_tokens: int,
        caches: Sequence[Mapping[bytes, int]] | None = None,
        scans: Sequence[HitScan] | None = None,
    ) -> tuple[int, dict[int, list[int]], int | None]:
        """``(hit, blocks per group, checkpoint_at)`` for a prompt whose hash-block hashes
        are ``hashes``, resuming at most at ``max_tokens``; ``caches`` / ``scans``: per
        group, the map to search and how, instead of the device caches and the rules' own
        scans (offload tiers' merged views)."""
        found: dict[int, list[int]] = {}
        settled: dict[int, int] = {}
        maps = self.caches if caches is None else caches
        how = self.hit_scans if scans is None else scans
        # A fixed point from any upper bound is the largest common position below it, so
        # the two phases give the same hit as one.
        shared = self._fixed_point(
            self.positional_order, max_tokens, hashes, found, settled, maps, how
        )
        hit = self._fixed_point(self.order, shared, hashes, found, settled, maps, how)
        checkpoint_at = None
        if self.state_groups and hit < shared:
            aligned = shared // self.common_block_tokens * self.common_block_tokens
            if aligned > hit:
                checkpoint_at = aligned
        return hit, found, checkpoint_at

    def _fixed_point(
        self,
        order: list[int],
        hit: int,
        hashes: Sequence[bytes],
        found: dict[int, list[int]],
        settled: dict[int, int],
        caches: Sequence[Mapping[bytes, int]],
        scans: Sequence[HitScan],
    ) -> int:
        """Ask ``order``'s groups in turn, each at most the current hit, until none lowers
        it; ``found`` / ``settled`` keep each group's last answer."""
        while True:
            pending = [gid for gid in order if settled.get(gid) != hit]
            if not pending:
                return hit
            for gid in pending:
                tokens = self.block_tokens[gid]
                stride = self.hash_strides[gid]
                max_blocks = hit // tokens
                group_hashes = hashes[stride - 1 : max_blocks * stride : stride]
                blocks = scans[gid](group_hashes, caches[gid], max_blocks)
                if len(blocks) > max_blocks:
                    raise AllocatorError(
                        f"{self.rules[gid]!r}.longest_hit returned {len(blocks)} blocks for "
                        f"at most {max_blocks}"
                    )
                found[gid] = blocks
                position = len(blocks) * tokens
                hit = min(hit, position)
                settled[gid] = position
