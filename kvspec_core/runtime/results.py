"""What the allocator answers: a prefix hit, an allocation, a "not now", usage figures."""

from __future__ import annotations

import attrs

#: ``NotNow.reason`` when the pools lack free blocks (retry after something is freed).
NO_FREE_BLOCKS = "no_free_blocks"
#: ``NotNow.reason`` when the request would exceed the admission cap (the planner's formula).
OVER_ADMISSION_CAP = "over_admission_cap"
#: ``NotNow.reason`` when a prefix found earlier lost blocks to eviction (look it up again).
STALE_PREFIX = "stale_prefix"


@attrs.frozen(kw_only=True)
class CachedPrefix:
    """A prefix every group can resume from: pass it to ``allocate_slots(prefix=...)``.

    Attributes:
        request_id: the request it was found for.
        num_tokens: tokens already computed (the hit); a multiple of every group's block.
        block_ids: per group, the block table of the hit (``0`` = null entries).
        epochs: per pool, the eviction epoch when it was found (staleness check).
        checkpoint_at: where the prompt shares cached content with earlier prompts but
            some state group (Mamba) saved no checkpoint; end a prefill step exactly there
            (allocate ``checkpoint_at - num_tokens`` tokens first) so the state is saved
            and later requests sharing the prefix resume from it. ``None`` otherwise.
    """

    # The compiled lookup builds instances by filling these slots (no __init__ call): keep
    # them plain fields, with no converter or validator.

    request_id: str | int
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    epochs: tuple[int, ...]
    checkpoint_at: int | None = None


@attrs.frozen(kw_only=True)
class Allocated:
    """Slots were allocated; ``new_block_ids[g]`` are the blocks group ``g`` received."""

    # The compiled kernels build instances by filling this slot (no __init__ call): keep it
    # the one field, with no converter or validator.

    new_block_ids: tuple[tuple[int, ...], ...]

    ok = True

    def __bool__(self) -> bool:
        return True


@attrs.frozen(kw_only=True)
class NotNow:
    """No slots were allocated and nothing changed.

    Attributes:
        reason: :data:`NO_FREE_BLOCKS`, :data:`OVER_ADMISSION_CAP` or :data:`STALE_PREFIX`.
        message: a sentence naming the group, the figures and what to do.
        group: the group that could not be served, when one group is the cause.
        blocks_needed / blocks_free: the shortfall, for :data:`NO_FREE_BLOCKS`.
    """

    reason: str
    message: str
    group: int | None = None
    blocks_needed: int = 0
    blocks_free: int = 0

    ok = False

    def __bool__(self) -> bool:
        return False


@attrs.frozen(kw_only=True)
class Usage:
    """Blocks of all pools together (null blocks excluded)."""

    used_blocks: int
    free_blocks: int
    cached_blocks: int
    usable_blocks: int

    @property
    def fraction(self) -> float:
        """Share of usable blocks held by requests (cached free blocks count as free)."""
        return self.used_blocks / self.usable_blocks if self.usable_blocks else 0.0
