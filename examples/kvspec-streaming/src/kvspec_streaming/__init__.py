"""StreamingLLM attention for kvspec: a request attends to its first ``sink_tokens`` and its
last ``recent_tokens``; everything between is dropped. The recent window is paged: its
blocks are freed as they fall out of it (the rules below). The sink tokens' K/V (a few per
request) are kept by the engine beside the paged cache, since kvspec's allocator frees a
leading run of a request's blocks, so the first block could not stay in its table."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvspec_core import (
    AttentionSpec,
    KVSpec,
    LayerConfig,
    SizingContext,
    TrailingWindowRules,
    cdiv,
    hookimpl,
)
from kvspec_core.validation import positive_int

kvspec_contract_version = 1


@attrs.frozen(kw_only=True)
class StreamingAttentionSpec(AttentionSpec):
    kind: ClassVar[str] = "streaming_attention"

    sink_tokens: int = attrs.field(validator=positive_int)
    recent_tokens: int = attrs.field(validator=positive_int)

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        # The window may start mid-block, hence the extra block (as for sliding windows).
        recent = min(self.recent_tokens - 1 + ctx.max_in_flight_tokens, ctx.max_model_len)
        return min(cdiv(recent, self.block_size) + 1, cdiv(ctx.max_model_len, self.block_size))


class StreamingRules(TrailingWindowRules):
    """Free a request's blocks once they are out of its recent window. A kind without rules
    of its own would get full attention's, which free nothing: the allocator refuses them
    for a spec sized for fewer blocks."""

    def __init__(self, spec: StreamingAttentionSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.retained_tokens = spec.recent_tokens - 1


@hookimpl
def kvspec_register_spec_kinds(register) -> None:
    register(StreamingAttentionSpec)


@hookimpl
def kvspec_register_runtime_rules(register) -> None:
    register(StreamingAttentionSpec.kind, StreamingRules)


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
