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
block at the largest boundary ``<= p``, everything before it null. Every state block it
caches is such a checkpoint, so all of them are worth keeping in slower tiers: the rules
define no ``offload_range`` (the default: every state the device evicts is stored below).

In ``none`` (and ``all``, whose per-block states the admission cap has no room for) mode a
request holds its running state plus speculative states, updated in place, never cached:
a model with such a group never resumes from a prefix.

The ``align`` rules are the core's :class:`~kvspec_core.runtime.rules.StateCheckpointRules`
shape; :func:`mamba_rules`, registered for the kind, picks the rules of the context's mode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvspec_core.context import SizingContext
from kvspec_core.plugins.contract import hookimpl
from kvspec_core.plugins.hookspecs import RegisterRuntimeRules
from kvspec_core.runtime.rules import (
    NEVER,
    FamilyRules,
    FullAttentionRules,
    StateCheckpointRules,
)
from kvspec_mamba.specs import MambaSpec


class MambaRules(StateCheckpointRules):
    """Rules of one Mamba-state group in ``align`` mode: the core's state-checkpoint shape
    (whose steps the compiled kernels do), with the state's block size (states are
    replicated across DCP ranks, not sharded)."""

    def __init__(self, spec: MambaSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.block_tokens = spec.block_size
        self.prefix_cacheable = ctx.prefix_caching and bool(spec.prefix_cacheable)


class MambaRunningStateRules(FullAttentionRules):
    """Rules of one Mamba-state group in ``none`` / ``all`` mode: the running state plus
    speculative states, updated in place, never cached."""

    hit_priority = 2
    resumes_at_checkpoints = True

    def __init__(self, spec: MambaSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.block_tokens = spec.block_size
        self.prefix_cacheable = False
        self.fixed_states = 1 + getattr(spec, "num_speculative_blocks", 0)

    def longest_hit(
        self, hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
    ) -> list[int]:
        return []

    def blocks_needed(
        self, num_existing: int, num_known: int, num_total: int, num_encoder_tokens: int
    ) -> tuple[int, int]:
        return (0, 0) if num_existing else (0, self.fixed_states)

    def next_allocation_end(self, num_existing: int) -> int:
        return NEVER if num_existing else 1

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        boundary = num_known // self.block_tokens
        return boundary, boundary


def mamba_rules(spec: MambaSpec, ctx: SizingContext) -> FamilyRules:
    """The rules of one Mamba-state group for the context's ``mamba_cache_mode``."""
    if ctx.mamba_cache_mode == "align":
        return MambaRules(spec, ctx)
    return MambaRunningStateRules(spec, ctx)


@hookimpl
def kvspec_register_runtime_rules(register: RegisterRuntimeRules) -> None:
    register("mamba", mamba_rules)
