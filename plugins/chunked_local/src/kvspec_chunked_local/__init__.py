"""kvspec plugin for the chunked local attention family (``chunked_local_attention``)."""

from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec

__all__ = ["ChunkedLocalAttentionSpec"]
