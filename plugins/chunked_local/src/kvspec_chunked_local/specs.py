"""Chunked local attention: each token attends within its fixed ``attention_chunk_size`` chunk.

Sizing follows the reference engine: a request holds the tokens of its current chunk plus the
tokens in flight (frees happen only once tokens are processed), never more than
``max_model_len``: ``cdiv(min(chunk + in_flight, max_model_len), block_size)`` blocks. That
count assumes the held range starts on a block boundary, which chunk boundaries are exactly
when ``block_size`` divides ``attention_chunk_size`` (every published model); otherwise the
range may straddle one more block, and the cap adds it rather than under-admit.

Decode context parallelism (DCP) is supported with the sliding window's per-rank argument:
positions are spread over the ``dcp_size`` ranks in runs of an interleave that divides the
block size, so rank-local block ``j`` of every rank holds positions of the one global range
``[j * block_size * dcp_size, (j + 1) * block_size * dcp_size)``. A held range of ``n``
positions starting on a chunk boundary touches at most ``cdiv(n, block_size * dcp_size)``
such ranges when ``block_size * dcp_size`` divides the chunk, one more otherwise; and
``cdiv(n, block_size * dcp_size) == cdiv(cdiv(n, dcp_size), block_size)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import attrs

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.specs.base import KVSpec
from kvspec_core.validation import positive_int

if TYPE_CHECKING:
    from kvspec_core.specs.base import SpecKinds


@attrs.frozen(kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Attention within fixed chunks of ``attention_chunk_size`` tokens (Llama 4).

    Attributes:
        attention_chunk_size: tokens per chunk; a token attends only within its chunk.
    """

    kind: ClassVar[str] = "chunked_local_attention"

    attention_chunk_size: int = attrs.field(validator=positive_int)

    def retained_tokens(self, ctx: SizingContext) -> int:
        """Most tokens of one request held at once, across all DCP ranks together."""
        return min(self.attention_chunk_size + ctx.max_in_flight_tokens, ctx.max_model_len)

    def first_attended_position(self, position: int) -> int:
        """The start of ``position``'s chunk: a query reads only within its own chunk."""
        super().first_attended_position(position)
        return position - position % self.attention_chunk_size

    def rank_block_span(self, ctx: SizingContext) -> int:
        """Consecutive positions one rank-local block covers (``block_size`` x DCP shards)."""
        shards = ctx.dcp_size if self.dcp_sharded else 1
        return self.block_size * shards

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        span = self.rank_block_span(ctx)
        # Chunks start on a block boundary only when the span divides the chunk size.
        straddle = 0 if self.attention_chunk_size % span == 0 else 1
        return cdiv(self.retained_tokens(ctx), span) + straddle

    def is_uniform_with(self, specs: Mapping[str, KVSpec], registry: SpecKinds) -> bool:
        """Uniform with chunked-local layers of the same chunk size: layers with different
        chunks free blocks at different positions, so they never share a group."""
        base = registry.uniform_base_of(self)
        return all(
            registry.uniform_base_of(spec) is base
            and getattr(spec, "attention_chunk_size", None) == self.attention_chunk_size
            for spec in specs.values()
        )
