"""Full attention and sink full attention: every token of the request stays cached."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, TypeVar

import attrs

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.errors import MergeError
from kvspec_core.specs.attention import AttentionSpec
from kvspec_core.validation import is_bool, non_negative_int, optional, positive_int

FullSpecT = TypeVar("FullSpecT", bound="FullAttentionSpec")


@attrs.frozen(kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Attention over the whole request.

    When no hybrid planner is used, sliding-window or chunked layers may be planned as full
    attention (blocks for every token) while computed locally; ``sliding_window`` /
    ``attention_chunk_size`` record that for kernels, and ``non_causal`` marks prefix-LM layers.
    """

    kind: ClassVar[str] = "full_attention"
    merge_any_fields: ClassVar[frozenset[str]] = frozenset({"non_causal"})
    merge_optional_fields: ClassVar[frozenset[str]] = frozenset(
        {"sliding_window", "attention_chunk_size"}
    )

    sliding_window: int | None = attrs.field(default=None, validator=optional(positive_int))
    attention_chunk_size: int | None = attrs.field(default=None, validator=optional(positive_int))
    non_causal: bool = attrs.field(default=False, validator=is_bool)

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return cdiv(self.tokens_held_per_rank(ctx, ctx.max_model_len), self.block_size)

    def first_attended_position(self, position: int) -> int:
        """0, unless the layer computes locally while planned as full attention: then the
        recorded ``sliding_window`` / ``attention_chunk_size`` bounds what a query reads."""
        start = super().first_attended_position(position)
        if self.sliding_window is not None:
            return max(start, position - self.sliding_window + 1)
        if self.attention_chunk_size is not None:
            return position - position % self.attention_chunk_size
        return start

    @classmethod
    def merge(
        cls: type[FullSpecT], specs: Sequence[FullSpecT], layer_names: Sequence[str] = ()
    ) -> FullSpecT:
        merged = super().merge(specs, layer_names)
        if merged.sliding_window is not None and merged.attention_chunk_size is not None:
            raise MergeError(
                "layers cannot share one full-attention group: some record sliding_window="
                f"{merged.sliding_window} and others attention_chunk_size="
                f"{merged.attention_chunk_size}; one recorded local pattern per group. Install "
                "kvspec-sliding-window and kvspec-chunked-local to plan them as their own groups"
            )
        return merged


@attrs.frozen(kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention whose first ``sink_len`` tokens are attention sinks kept for kernels."""

    kind: ClassVar[str] = "sink_full_attention"

    sink_len: int | None = attrs.field(default=None, validator=optional(non_negative_int))
