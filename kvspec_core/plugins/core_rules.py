"""The core's rule shapes: full attention, cross attention, one block per request, a
trailing window, recurrent-state checkpoints. Plugins subclass them and override what
differs (see :mod:`kvspec_core.plugins.family_rules` for the contract they implement).

Part of the plugin contract, so the core's own plugin (``builtin``) registers them like any
plugin registers its rules; the runtime re-exports them from :mod:`kvspec_core.runtime.rules`
and runs the block-boundary steps of the parametric shapes as compiled kernels.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.plugins.family_rules import NEVER, RulesFactory, block_tokens_of
from kvspec_core.specs.base import KVSpec


class FullAttentionRules:
    """Full attention: every block of the request is kept; a hit is the longest run of
    cached blocks from the start (a block's hash covers its whole prefix)."""

    hit_priority = 0

    def __init__(self, spec: KVSpec, ctx: SizingContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.block_tokens = block_tokens_of(spec, ctx)
        self.prefix_cacheable = bool(spec.prefix_cacheable)

    def skipped_tokens(self, num_computed: int) -> int:
        return 0

    def next_skip_position(self, num_skipped_blocks: int) -> int:
        return NEVER

    def longest_hit(
        self, hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
    ) -> list[int]:
        if not self.prefix_cacheable:
            return []
        # The runtime runs this very scan compiled (runtime/rules.py: hit_scanner).
        found: list[int] = []
        get = cache.get
        append = found.append
        for digest in hashes[:max_blocks]:
            block = get(digest)
            if block is None:
                break
            append(block)
        return found

    def blocks_needed(
        self, num_existing: int, num_known: int, num_total: int, num_encoder_tokens: int
    ) -> tuple[int, int]:
        return 0, max(0, cdiv(num_total, self.block_tokens) - num_existing)

    def next_allocation_end(self, num_existing: int) -> int:
        return num_existing * self.block_tokens + 1

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        return num_cached, max(num_cached, num_known // self.block_tokens)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.kind}, block_tokens={self.block_tokens})"


class CrossAttentionRules(FullAttentionRules):
    """Cross attention: the encoder's K/V, allocated once when the request is admitted.

    Encoder outputs depend on the whole encoder input, not on a token prefix, so the group
    is never prefix-cached and a request with cross attention never resumes from a prefix.
    """

    def __init__(self, spec: KVSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.block_tokens = spec.block_size
        self.prefix_cacheable = False

    def blocks_needed(
        self, num_existing: int, num_known: int, num_total: int, num_encoder_tokens: int
    ) -> tuple[int, int]:
        return 0, max(0, cdiv(num_encoder_tokens, self.block_tokens) - num_existing)

    def next_allocation_end(self, num_existing: int) -> int:
        return NEVER

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        return num_cached, num_cached


class SingleBlockRules(FullAttentionRules):
    """One block for the request's whole life, rewritten in place (ring buffers, scratch
    tails); never prefix-cached, so a request holding one never resumes from a prefix."""

    def __init__(self, spec: KVSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.prefix_cacheable = False

    def blocks_needed(
        self, num_existing: int, num_known: int, num_total: int, num_encoder_tokens: int
    ) -> tuple[int, int]:
        return (0, 0) if num_existing else (0, 1)

    def next_allocation_end(self, num_existing: int) -> int:
        return NEVER if num_existing else 1

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        return num_cached, num_cached


class TrailingWindowRules(FullAttentionRules):
    """A trailing window: a step's queries read the ``retained_tokens`` positions before
    them (and themselves), so blocks entirely below ``num_computed - retained_tokens`` are
    freed. A family of this shape (sliding window attention) subclasses it, sets
    ``retained_tokens`` in ``__init__`` and supplies its :meth:`longest_hit` (which cached
    blocks a hit needs is the family's).

    Groups whose rules keep this class's step methods (``skipped_tokens``,
    ``next_skip_position``, ``blocks_needed``, ``next_allocation_end``, ``cache_range``)
    and do not change ``block_tokens`` or ``retained_tokens`` after ``__init__`` have their
    block-boundary steps done by the compiled kernels (the allocator reads both once).
    """

    hit_priority = 1
    #: Positions before the next query that the group still reads.
    retained_tokens: int = 0

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - self.retained_tokens)

    def next_skip_position(self, num_skipped_blocks: int) -> int:
        return (num_skipped_blocks + 1) * self.block_tokens + self.retained_tokens

    def offload_range(self, num_cached: int) -> tuple[int, int]:
        """Worth keeping in slower tiers: a freed request's last window, the blocks of the
        ``retained_tokens`` positions before its cached end (all of them while that end is
        inside the first window), so a later request can resume where it ended. The
        blocks it released mid-request (out of its window) are dropped at eviction."""
        need = cdiv(self.retained_tokens, self.block_tokens)
        return max(0, num_cached - need), num_cached


class StateCheckpointRules(FullAttentionRules):
    """Recurrent state saved at block boundaries (a state family's prefix-caching mode).

    One block holds one state. The block table is indexed by position: entry ``j`` holds
    the state after ``(j + 1) * block_tokens`` tokens, or the running state while the
    request is inside block ``j``. Only the entries a request needs are real blocks (the
    state a step starts from, the one it ends in, the lookahead's); every other entry is
    the null block. A state block enters the prefix cache only when a step ends exactly on
    its boundary (only then does it hold the state there), and a hit is the cached state at
    the largest boundary ``<= p``, everything before it null.

    Every state it caches is a checkpoint a later request can resume from, so it keeps
    the default of what is worth keeping in slower tiers (no ``offload_range``: every
    state the device evicts is stored below it).

    A family of this shape (Mamba, linear attention) subclasses it and sets
    ``block_tokens`` and ``prefix_cacheable``. As for :class:`TrailingWindowRules`, groups
    that keep its methods get compiled block-boundary steps.
    """

    hit_priority = 2
    resumes_at_checkpoints = True

    def skipped_tokens(self, num_computed: int) -> int:
        if num_computed <= 0:
            return 0
        # Keep only the block holding the state at num_computed (where the step starts).
        return (num_computed - 1) // self.block_tokens * self.block_tokens

    def next_skip_position(self, num_skipped_blocks: int) -> int:
        return (num_skipped_blocks + 1) * self.block_tokens + 1

    def longest_hit(
        self, hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
    ) -> list[int]:
        if not self.prefix_cacheable:
            return []
        get = cache.get
        for index in range(max_blocks - 1, -1, -1):
            block = get(hashes[index])
            if block is not None:
                return [0] * index + [block]
        return []

    def blocks_needed(
        self, num_existing: int, num_known: int, num_total: int, num_encoder_tokens: int
    ) -> tuple[int, int]:
        if num_total <= 0:
            return 0, 0
        target = (num_total - 1) // self.block_tokens + 1
        if target <= num_existing:
            return 0, 0
        first_real = max(num_existing, max(num_known - 1, 0) // self.block_tokens)
        return first_real - num_existing, target - first_real

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        boundary = num_known // self.block_tokens
        if not self.prefix_cacheable or num_known % self.block_tokens:
            return boundary, boundary
        return max(num_cached, boundary - 1), boundary


#: The core's rules per core kind (registered through ``kvspec_register_runtime_rules``).
CORE_RULES: dict[str, RulesFactory] = {
    "full_attention": FullAttentionRules,
    "sink_full_attention": FullAttentionRules,
    "cross_attention": CrossAttentionRules,
    # Encoder-only layers hold no blocks (their admission cap is 0); the allocator skips them.
    "encoder_only_attention": FullAttentionRules,
}
