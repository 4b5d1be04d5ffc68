"""Turning a ``chunked_attention`` model layer into a :class:`ChunkedLocalAttentionSpec`."""

from __future__ import annotations

from typing import Any

from kvspec_core.errors import ConfigError
from kvspec_core.models.layer import LayerConfig
from kvspec_core.validation import MAX_FIELD_VALUE

from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec

#: The normalised layer type this family claims.
CHUNKED_LAYER_TYPE = "chunked_attention"
#: Config field holding the chunk size, in tokens.
CHUNK_FIELD = "attention_chunk_size"


def attention_fields(layer: LayerConfig) -> dict[str, Any]:
    """The attention-geometry fields of ``layer``'s spec, from the core's resolved shape."""
    shape = layer.attention
    if shape is None:
        raise ConfigError(
            f"layer {layer.name} is a {layer.layer_type} layer but the config gives no attention "
            "geometry (num_key_value_heads / head_dim); fix the model config"
        )
    return dict(
        block_size=layer.options.block_size,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        head_size_v=shape.head_size_v,
        dtype=shape.dtype,
        kv_quant_mode=shape.kv_quant_mode,
        max_tp_shards=shape.total_kv_heads,
    )


def chunk_size_of(layer: LayerConfig) -> int:
    """The layer's chunk from ``attention_chunk_size``; refused unless a positive int."""
    chunk = layer.config.get(CHUNK_FIELD)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not 0 < chunk <= MAX_FIELD_VALUE:
        raise ConfigError(
            f"layer {layer.name} is a chunked local attention layer but config field "
            f"{CHUNK_FIELD!r} is {chunk!r}; it must be a positive int (tokens per chunk). Set "
            f"{CHUNK_FIELD!r} in the config, or type the layer as full attention"
        )
    return chunk


def chunked_local_spec(layer: LayerConfig) -> ChunkedLocalAttentionSpec | None:
    """The spec of ``layer`` if it is a chunked local attention layer, else ``None``."""
    if layer.layer_type != CHUNKED_LAYER_TYPE:
        return None
    return ChunkedLocalAttentionSpec(attention_chunk_size=chunk_size_of(layer),
                                     **attention_fields(layer))
