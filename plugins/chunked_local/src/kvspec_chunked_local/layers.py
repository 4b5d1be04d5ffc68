"""Turning a ``chunked_attention`` model layer into a :class:`ChunkedLocalAttentionSpec`."""

from __future__ import annotations


from kvspec_core.errors import ConfigError
from kvspec_core.models.layer import LayerConfig
from kvspec_core.validation import MAX_FIELD_VALUE

from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec

#: The normalised layer type this family claims.
CHUNKED_LAYER_TYPE = "chunked_attention"
#: Config field holding the chunk size, in tokens.
CHUNK_FIELD = "attention_chunk_size"


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
                                     **layer.attention_spec_fields())
