"""The runtime-rules contract: what a family's rules object answers for one group.

Part of the plugin contract (beneath the runtime and the planner; it imports neither). A
plugin registers a *rules factory* per kind through ``kvspec_register_runtime_rules``:
``register("my_kind", MyRules)`` where ``MyRules(spec, ctx)`` returns an object satisfying
:class:`FamilyRules` for one group (``spec`` is the group's spec, or the first member of a
uniform-type group). The core's shapes to subclass are in
:mod:`kvspec_core.plugins.core_rules` (re-exported by :mod:`kvspec_core.runtime.rules`).

Positions are counted in tokens of the request; a group's block ``j`` covers positions
``[j * block_tokens, (j + 1) * block_tokens)``. ``block_tokens`` is the block size times the
decode-context-parallel size for DCP-sharded caches (each rank holds every ``dcp``-th token,
so one local block spans ``block_size * dcp`` positions).

The admission cap is not a rule: the allocator always takes it from
``spec.max_blocks_per_request(ctx)``, the formula the planner sizes the pools with.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from kvspec_core.context import SizingContext
from kvspec_core.specs.base import KVSpec

#: "Never": a position no request reaches.
NEVER = sys.maxsize


@runtime_checkable
class FamilyRules(Protocol):
    """Runtime behaviour of one group's family (see the module docstring).

    Attributes:
        block_tokens: request positions one block spans.
        prefix_cacheable: whether blocks of this group enter the prefix cache; a group that
            is not cannot resume from any prefix, so the whole request's hit is 0.
        hit_priority: groups with lower values are asked for hits first; put families whose
            hit is a plain prefix scan (full attention) first so that others scan less.

    Optional attribute ``resumes_at_checkpoints`` (default ``False``): ``True`` for state
    families that resume only where a step ended (Mamba); the allocator then tells the
    engine where ending a prefill step would save a reusable checkpoint.

    Optional attribute ``caches_prompt_only`` (default ``False``): ``True`` for families
    whose K/V past the prompt depend on where the prompt ended, not on the tokens alone
    (R-SWA: a generated token attends the prompt and the last few generated tokens, a
    prompt token every earlier one), so a block holding a generated position must not be
    a hit for a request that has it in its prompt. The allocator then caches only the
    blocks entirely inside the request's ``num_prompt_tokens``; such a group's steps run
    as Python (the compiled kernels cache every full block).

    Optional method ``offload_range(num_cached: int) -> tuple[int, int]``: which of the
    group's blocks are worth keeping in slower tiers (asked by an allocator whose offload
    tier says ``keep="family_rules"``; absent, the default, or with the tier's default
    ``keep="everything"``, every cached block the device evicts is stored below it).
    When a request is freed, ``(start, stop)`` names the entries of its table, among the
    ``num_cached`` cached ones (``0 <= start <= stop <= num_cached``), whose blocks are
    stored when the device evicts them; every other block of the group, among them those a
    request released mid-request (:meth:`skipped_tokens`), is dropped at eviction. What a
    hit needs is still decided by :meth:`longest_hit` over what the tiers hold, so a rule
    that keeps too little loses hits but never makes a false one. The core's trailing
    window keeps a freed request's last window (what resuming at its end needs); state
    checkpoints keep the default (every state they cache is a checkpoint). It must be a
    method (one that is not callable is refused when the allocator is built); it is asked
    before a free, a ``discard_uncomputed`` or a failed load's discard changes anything,
    so an answer out of range, or an exception, refuses that call with
    :class:`~kvspec_core.errors.AllocatorError` naming the group, changing nothing.
    """

    block_tokens: int
    prefix_cacheable: bool
    hit_priority: int

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading positions whose blocks the group no longer needs once ``num_computed``
        tokens are computed (the next step's queries start at ``num_computed``). Blocks
        entirely below ``skipped_tokens(...) // block_tokens * block_tokens`` are freed."""
        ...

    def next_skip_position(self, num_skipped_blocks: int) -> int:
        """The smallest ``num_computed`` at which ``skipped_tokens(num_computed) //
        block_tokens`` exceeds ``num_skipped_blocks`` (:data:`NEVER` if it never does).
        Lets the allocator skip the rules entirely on most decode steps."""
        ...

    def longest_hit(
        self, hashes: Sequence[bytes], cache: Mapping[bytes, int], max_blocks: int
    ) -> list[int]:
        """Block ids for the largest ``k <= max_blocks`` such that the group can resume at
        position ``k * block_tokens`` from cached blocks. ``hashes[j]`` identifies block
        ``j``'s whole prefix, ``cache`` maps a hash to its cached block id. Positions the
        group does not need hold the null block ``0``. The result's length is ``k``."""
        ...

    def blocks_needed(
        self, num_existing: int, num_known: int, num_total: int, num_encoder_tokens: int
    ) -> tuple[int, int]:
        """``(nulls, real)``: entries to append to the block table, ``nulls`` null entries
        then ``real`` new blocks, so that a step ending at ``num_known`` tokens (plus
        lookahead slots up to ``num_total``) has room. ``num_existing`` entries exist."""
        ...

    def next_allocation_end(self, num_existing: int) -> int:
        """Smallest ``num_total`` for which :meth:`blocks_needed` would ask for entries."""
        ...

    def cache_range(self, num_cached: int, num_known: int) -> tuple[int, int]:
        """``(start, stop)``: block indices whose content is final once ``num_known``
        tokens are known and that may enter the prefix cache; ``num_cached`` blocks were
        handled before. The allocator continues from ``stop`` next time."""
        ...


#: What a plugin registers per kind: builds the rules of one group.
RulesFactory = Callable[[KVSpec, SizingContext], FamilyRules]


def block_tokens_of(spec: KVSpec, ctx: SizingContext) -> int:
    """Positions one block of ``spec`` spans (DCP-sharded caches span ``dcp`` times more)."""
    shards = ctx.dcp_size if spec.dcp_sharded else 1
    return spec.block_size * shards
