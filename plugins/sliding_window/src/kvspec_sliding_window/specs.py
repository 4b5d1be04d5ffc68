"""Sliding-window families: a window of recent tokens, a one-block tail, reference SWA.

Sizing follows the reference engine: a sliding-window request holds the last
``sliding_window - 1`` computed tokens, the ``extra_retained_tokens`` kept below the window
for multi-module speculative decoding, and the tokens in flight (frees happen only once
tokens are processed), never more than ``max_model_len``; one more block covers a window
that does not start on a block boundary.

Unlike the reference engine, decode context parallelism (DCP) is supported. DCP spreads
token positions over the ``dcp_size`` ranks in runs of ``interleave`` tokens (``interleave``
divides ``block_size``), so rank-local block ``j`` of every rank holds positions from the one
global range ``[j * block_size * dcp_size, (j + 1) * block_size * dcp_size)``. A contiguous
range of ``n`` positions therefore touches, on any rank, at most the
``cdiv(n, block_size * dcp_size) + 1`` global ranges it overlaps, and
``cdiv(n, block_size * dcp_size) == cdiv(cdiv(n, dcp_size), block_size)``: the per-rank cap
is ``cdiv(cdiv(n, dcp_size), block_size) + 1``. (With one-token interleave each rank also
holds at most ``cdiv(n, dcp_size)`` of the range's tokens.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import attrs

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.full_attention import FullAttentionSpec
from kvspec_core.validation import non_negative_int, positive_int

if TYPE_CHECKING:
    from kvspec_core.specs.base import SpecKinds


@attrs.frozen(kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Attention over the last ``sliding_window`` tokens; older blocks are freed.

    Attributes:
        sliding_window: tokens a query attends to, itself included.
        extra_retained_tokens: tokens kept (not attended) below the window, so that
            multi-module speculative decoding can re-prefill them.
    """

    kind: ClassVar[str] = "sliding_window"

    sliding_window: int = attrs.field(validator=positive_int)
    extra_retained_tokens: int = attrs.field(default=0, validator=non_negative_int)

    def retained_tokens(self, ctx: SizingContext) -> int:
        """Most tokens of one request held at once, across all DCP ranks together."""
        return min(
            self.sliding_window - 1 + self.extra_retained_tokens + ctx.max_in_flight_tokens,
            ctx.max_model_len,
        )

    def first_attended_position(self, position: int) -> int:
        """The window's start: a query at ``position`` reads the last ``sliding_window``
        positions, itself included (``extra_retained_tokens`` are kept, not attended)."""
        return max(super().first_attended_position(position), position - self.sliding_window + 1)

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        # +1: the retained range need not start on a block boundary (block size 4 holding
        # the 4 tokens CDEF needs [xxCD][EF..]). Under DCP the range's tokens on one rank are
        # consecutive in that rank's local numbering, so the same +1 argument applies there.
        return cdiv(self.tokens_held_per_rank(ctx, self.retained_tokens(ctx)), self.block_size) + 1

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        """Uniform with specs of the same uniform-type kind and the same window: layers with
        different windows free blocks at different times, so they never share a group."""
        base = registry.uniform_base_of(self)
        return all(
            registry.uniform_base_of(spec) is base
            and getattr(spec, "sliding_window", None) == self.sliding_window
            for spec in specs.values()
        )


@attrs.frozen(kw_only=True)
class KpoolTailSpec(SlidingWindowSpec):
    """One-block circular scratch cache holding a kpool indexer's raw tail.

    The block is addressed by the kernel itself (no slot mapping) and lives as long as the
    request, so a request holds exactly one block whatever its length.
    """

    kind: ClassVar[str] = "kpool_tail"

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return 1

    def block_table_width(self, ctx: SizingContext, max_len: int) -> int:
        return 1

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        return all(isinstance(spec, KpoolTailSpec) for spec in specs.values())

    @property
    def prefix_cacheable(self) -> bool:
        # The tail is overwritten in place; no block ever holds a stable prefix.
        return False

    @property
    def uses_slot_mapping(self) -> bool:
        return False


@attrs.frozen(kw_only=True)
class ReferenceSlidingWindowSpec(FullAttentionSpec):
    """Reference sliding-window attention (R-SWA).

    Prefill tokens (image and text prompt) stay visible to every later token; of the
    generated tokens only the last ``rswa_window`` are kept, and the gap blocks between the
    prefill tail and the decode window are evicted as decoding advances. Startup sizing is
    full attention's (a prompt may fill ``max_model_len``).

    Layers merge under full attention's rule (every field equal but ``non_causal``), so a
    group holds one ``rswa_window``; a disagreement is refused naming the field, the values
    and the layers.

    Attributes:
        rswa_window: generated tokens kept in the cache.
    """

    kind: ClassVar[str] = "reference_sliding_window"

    rswa_window: int = attrs.field(validator=positive_int)

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        """Uniform only with R-SWA layers of the same window: their gap-block eviction differs
        from full attention's, so they never share a full-attention group."""
        return all(
            isinstance(spec, ReferenceSlidingWindowSpec) and spec.rswa_window == self.rswa_window
            for spec in specs.values()
        )
