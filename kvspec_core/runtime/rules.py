"""Per-family runtime rules: what a group frees, which cache hits it can resume from, how
many blocks it needs. The allocator is generic; everything family-specific lives here.

A plugin registers a *rules factory* per kind through ``kvspec_register_runtime_rules``:
``register("my_kind", MyRules)`` where ``MyRules(spec, ctx)`` returns an object satisfying
:class:`FamilyRules` for one group (``spec`` is the group's spec, or the first member of a
uniform-type group). Subclass :class:`FullAttentionRules` and override what differs.

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
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.errors import AllocatorError, KVSpecError, PluginError
from kvspec_core.runtime.native import native
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.uniform import UniformTypeSpecs

if TYPE_CHECKING:
    from kvspec_core.plugins.manager import PluginManager

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
        if native is not None and hashes.__class__ is list and cache.__class__ is dict:
            return native.longest_hit(hashes, cache, max_blocks)
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


class StateCheckpointRules(FullAttentionRules):
    """Recurrent state saved at block boundaries (a state family's prefix-caching mode).

    One block holds one state. The block table is indexed by position: entry ``j`` holds
    the state after ``(j + 1) * block_tokens`` tokens, or the running state while the
    request is inside block ``j``. Only the entries a request needs are real blocks (the
    state a step starts from, the one it ends in, the lookahead's); every other entry is
    the null block. A state block enters the prefix cache only when a step ends exactly on
    its boundary (only then does it hold the state there), and a hit is the cached state at
    the largest boundary ``<= p``, everything before it null.

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


#: The rules methods a block-boundary step asks (what the compiled step does itself).
STEP_METHODS = (
    "skipped_tokens", "next_skip_position", "blocks_needed", "next_allocation_end",
    "cache_range",
)
#: The core's parametric rule shapes the compiled step knows, by its code for them.
COMPILED_SHAPES: tuple[type[FullAttentionRules], ...] = (
    FullAttentionRules, TrailingWindowRules, StateCheckpointRules,
)


def compiled_shape(rules: object) -> int | None:
    """The index in :data:`COMPILED_SHAPES` of the shape whose step methods ``rules`` keeps
    (a subclass that overrides none of them), or ``None`` (its steps run as Python)."""
    for code, shape in enumerate(COMPILED_SHAPES):
        if isinstance(rules, shape) and all(
            getattr(type(rules), name) is getattr(shape, name) for name in STEP_METHODS
        ):
            return code
    return None


#: The core's rules per core kind (registered through ``kvspec_register_runtime_rules``).
CORE_RULES: dict[str, RulesFactory] = {
    "full_attention": FullAttentionRules,
    "sink_full_attention": FullAttentionRules,
    "cross_attention": CrossAttentionRules,
    # Encoder-only layers hold no blocks (their admission cap is 0); the allocator skips them.
    "encoder_only_attention": FullAttentionRules,
}


def _rules_factory(
    spec: KVSpec, manager: PluginManager | None
) -> tuple[RulesFactory, str, str | None]:
    """The factory of ``spec``'s rules, the kind it was registered for, and the plugin that
    registered it (``None`` for the core's)."""
    # A kind without rules of its own behaves like its nearest ancestor kind that has some
    # (sliding-window MLA frees blocks like a sliding window, not like full attention).
    for klass in type(spec).__mro__:
        kind = getattr(klass, "kind", "")
        if not kind:
            continue
        if manager is not None:
            factory = manager.runtime_rules(kind)
            if factory is not None:
                return factory, kind, manager.spec_kinds.owner_of(kind)
        core = CORE_RULES.get(kind)
        if core is not None:
            return core, kind, None
    return CORE_RULES["full_attention"], "full_attention", None


def rules_plugin(spec: KVSpec, manager: PluginManager | None) -> tuple[str, str] | None:
    """``(plugin name, kind)`` of the plugin whose rules govern ``spec``'s group, or
    ``None`` when the core's rules do."""
    family_spec = spec.first_spec if isinstance(spec, UniformTypeSpecs) else spec
    _, kind, owner = _rules_factory(family_spec, manager)
    return None if owner is None else (owner, kind)


def rules_for(spec: KVSpec, ctx: SizingContext, manager: PluginManager | None) -> FamilyRules:
    """The rules of a group: those registered for its kind, else for its nearest ancestor
    kind, else full attention's. A uniform-type group uses its members' family's rules."""
    family_spec = spec.first_spec if isinstance(spec, UniformTypeSpecs) else spec
    factory, kind, owner = _rules_factory(family_spec, manager)
    try:
        rules = factory(family_spec, ctx)
    except KVSpecError:
        raise
    except Exception as error:
        if owner is None:
            raise
        raise PluginError(
            f"plugin {owner!r}: its runtime rules for kind {kind!r} raised "
            f"{type(error).__name__} when built for {family_spec.kind!r}: {error}; fix the "
            "plugin or leave it out (KVSPEC_PLUGINS)"
        ) from None
    if not isinstance(rules, FamilyRules):
        raise AllocatorError(
            f"runtime rules for kind {family_spec.kind!r} ({factory!r}) do not implement "
            "kvspec_core.runtime.rules.FamilyRules"
        )
    return rules


def plugin_rules_error(
    error: BaseException, rules: Sequence[object], owners: Sequence[tuple[str, str] | None]
) -> PluginError | None:
    """A :class:`PluginError` naming the plugin, kind and method when ``error`` was raised
    inside a plugin's rules object ``rules[i]`` (``owners[i]`` its plugin and kind), found
    from the traceback; ``None`` when no plugin rules are in it (an error of the caller or
    of kvspec itself, to be raised as it is)."""
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        owner_self = frame.f_locals.get("self")
        for index, candidate in enumerate(rules):
            if owner_self is candidate and owners[index] is not None:
                plugin, kind = owners[index]  # type: ignore[misc]
                return PluginError(
                    f"plugin {plugin!r}: its runtime rules for kind {kind!r} (group {index}) "
                    f"raised {type(error).__name__} in {frame.f_code.co_name}: {error}; the "
                    "allocator changed nothing; fix the plugin or leave it out (KVSPEC_PLUGINS)"
                )
        traceback = traceback.tb_next
    return None
