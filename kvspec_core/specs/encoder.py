"""Encoder-side attention: cross attention holds encoder states, encoder-only holds none."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.specs.attention import AttentionSpec


@attrs.frozen(kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder cross-attention: caches the encoder's K/V (``ctx.max_encoder_tokens``)."""

    kind: ClassVar[str] = "cross_attention"

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return cdiv(ctx.max_encoder_tokens, self.block_size)

    def fixed_blocks_per_request(self, ctx: SizingContext) -> int:
        # The encoder's tokens, whatever the decoder's length.
        return self.max_blocks_per_request(ctx)

    @property
    def prefix_cacheable(self) -> bool:
        # Encoder outputs depend on the whole input (audio, image), not a token prefix.
        return False


@attrs.frozen(kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional encoder attention: computed in one pass, nothing is cached."""

    kind: ClassVar[str] = "encoder_only_attention"

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return 0

    @property
    def prefix_cacheable(self) -> bool:
        return False
