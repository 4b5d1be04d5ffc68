"""StreamingLLM attention for kvspec: keep the first ``sink_tokens`` and the last
``recent_tokens`` of every request; everything between is dropped."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvspec_core import AttentionSpec, KVSpec, LayerConfig, SizingContext, cdiv, hookimpl
from kvspec_core.validation import positive_int

kvspec_contract_version = 1


@attrs.frozen(kw_only=True)
class StreamingAttentionSpec(AttentionSpec):
    kind: ClassVar[str] = "streaming_attention"

    sink_tokens: int = attrs.field(validator=positive_int)
    recent_tokens: int = attrs.field(validator=positive_int)

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        sink = min(self.sink_tokens, ctx.max_model_len)
        # The window may start mid-block, hence the extra block (as for sliding windows).
        recent = min(self.recent_tokens - 1 + ctx.max_in_flight_tokens, ctx.max_model_len)
        return min(
            cdiv(sink, self.block_size) + cdiv(recent, self.block_size) + 1,
            cdiv(ctx.max_model_len, self.block_size),
        )


@hookimpl
def kvspec_register_spec_kinds(register) -> None:
    register(StreamingAttentionSpec)


@hookimpl
def kvspec_layer_spec(layer: LayerConfig) -> KVSpec | None:
    if layer.layer_type != "streaming_attention":
        return None
    # Both helpers refuse bad config with a ConfigError naming the layer and the field.
    return StreamingAttentionSpec(
        sink_tokens=layer.positive_int("streaming_sink_tokens", "attention sink tokens kept"),
        recent_tokens=layer.positive_int("streaming_recent_tokens", "recent tokens kept"),
        **layer.attention_spec_fields(),
    )
