"""Runtime allocator rules of the Mamba / linear-attention state family.

One block holds one recurrent state. In ``align`` prefix-caching mode the block table is
indexed by position: entry ``j`` holds the state after ``(j + 1) * block_size`` tokens, or the
running state while the request is inside block ``j``. Only the entries a request needs are
real blocks (the state a step starts from, the one it ends in, speculative ones); every
other entry is the null block.

A state block enters the prefix cache only when a step ends exactly on its block boundary,
because only then does it hold the state at that boundary; a prefill that runs past a
boundary leaves no state there, so no hit is ever reported at a position whose state was
never written. Resuming at ``p`` needs exactly that checkpoint: a hit is the cached state
block at the largest boundary ``<= p``, everything before it null.

In ``none`` (and ``all``, whose per-block states the admission cap has no room for) mode a
request holds its running state plus speculative states, updated in place, never cached:
a model with such a group never resumes from a prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvspec_core.context import SizingContext
from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterRuntimeRules
from kvspec_core.runtime.rules import NEVER, FullAttentionRules

from kvspec_mamba.specs import MambaSpec


class MambaRules(FullAttentionRules):
    """Rules of one Mamba-state group."""

    hit_priority = 2
    #: Resumes only where a step ended on a block boundary (see the allocator's
    #: ``CachedPrefix.checkpoint_at``), not from any cached token range.
    resumes_at_checkpoints = True

    def __init__(self, spec: MambaSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.block_tokens = spec.block_size  # states are replicated across DCP ranks
        self.align = ctx.mamba_cache_mode == "align"
        self.prefix_cacheable = self.align and ctx.prefix_caching and spec.prefix_cacheable
        self.fixed_states = 1 + getattr(spec, "num_speculative_blocks", 0)

    def skipped_tokens(self, num_computed: int) -> int:
        if not self.align or num_computed <= 0:
            return 0
        # Keep only the block holding the state at num_computed (where the step starts).
        return (num_computed - 1) // self.block_tokens * self.block_tokens

    def next_skip_position(self, num_skipped_blocks: int) -> int:
        if not self.align:
            return NEVER
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
        if not self.align:
            return (0, 0) if num_existing else (0, self.fixed_states)
        if num_total <= 0:
            return 0, 0
        target = (num_total - 1) // self.block_tokens + 1
        if target <= num_existing:
            return 0, 0
        first_real = max(num_existing, max(num_known - 1, 0) // self.block_tokens)
        return first_real - num_existing, target - first_real

    def next_allocation_end(self, num_existing: int) -> int:
        if not self.align:
            return NEVER if num_existing else 1
        return num_existing * self.block_tokens + 1

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        boundary = num_known // self.block_tokens
        if not self.prefix_cacheable or num_known % self.block_tokens:
            return boundary, boundary
        return max(num_cached, boundary - 1), boundary


@hookimpl
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    register("mamba", MambaRules)
