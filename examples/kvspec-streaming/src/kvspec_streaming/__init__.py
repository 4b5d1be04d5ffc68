"""StreamingLLM attention for kvspec: keep the first ``sink_tokens`` and the last
``recent_tokens`` of every request; everything between is dropped."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvspec_core import AttentionSpec, KVSpec, LayerConfig, SizingContext, cdiv, hookimpl
from kvspec_core.errors import ConfigError
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
        return min(cdiv(sink, self.block_size) + cdiv(recent, self.block_size) + 1,
                   cdiv(ctx.max_model_len, self.block_size))


@hookimpl
def kvspec_register_spec_kinds(register) -> None:
    register(StreamingAttentionSpec)


@hookimpl
def kvspec_layer_spec(layer: LayerConfig) -> KVSpec | None:
    if layer.layer_type != "streaming_attention" or layer.attention is None:
        return None
    sink, recent = layer.get("streaming_sink_tokens"), layer.get("streaming_recent_tokens")
    if not isinstance(sink, int) or not isinstance(recent, int):
        raise ConfigError(
            f"layer {layer.name}: streaming_attention needs integer config fields "
            "'streaming_sink_tokens' and 'streaming_recent_tokens'"
        )
    shape = layer.attention
    return StreamingAttentionSpec(
        block_size=layer.options.block_size, num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size, dtype=shape.dtype, kv_quant_mode=shape.kv_quant_mode,
        sink_tokens=sink, recent_tokens=recent,
    )
