"""Turning a ``chunked_attention`` model layer into a :class:`ChunkedLocalAttentionSpec`."""

from __future__ import annotations

from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec
from kvspec_core.plugins.layer_config import LayerConfig

#: The normalised layer type this family claims.
CHUNKED_LAYER_TYPE = "chunked_attention"
#: Config field holding the chunk size, in tokens.
CHUNK_FIELD = "attention_chunk_size"


def chunk_size_of(layer: LayerConfig) -> int:
    """The layer's chunk from ``attention_chunk_size``; refused unless a positive int."""
    return layer.positive_int(
        CHUNK_FIELD,
        "tokens per chunk",
        f"Set {CHUNK_FIELD!r} in the config, or type the layer as full attention",
    )


def chunked_local_spec(layer: LayerConfig) -> ChunkedLocalAttentionSpec | None:
    """The spec of ``layer`` if it is a chunked local attention layer, else ``None``."""
    if layer.layer_type != CHUNKED_LAYER_TYPE:
        return None
    return ChunkedLocalAttentionSpec(
        attention_chunk_size=chunk_size_of(layer), **layer.attention_spec_fields()
    )
