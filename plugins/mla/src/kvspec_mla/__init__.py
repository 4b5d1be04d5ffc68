"""kvspec plugin for the MLA families: ``mla_attention``, ``hidden_state_cache``,
``sliding_window_mla`` and ``circular_buffer``; registers the ``fp8_ds_mla`` KV-cache dtype."""

from kvspec_mla.formats import DS_MLA_FORMATS, MLA_KV_DTYPES, DSMLAFormat, ds_mla_format
from kvspec_mla.layers import mla_layer_spec
from kvspec_mla.sliding import SlidingWindowMLASpec
from kvspec_mla.specs import CircularBufferSpec, HiddenStateCacheSpec, MLAAttentionSpec

__all__ = [
    "DS_MLA_FORMATS",
    "MLA_KV_DTYPES",
    "CircularBufferSpec",
    "DSMLAFormat",
    "HiddenStateCacheSpec",
    "MLAAttentionSpec",
    "SlidingWindowMLASpec",
    "ds_mla_format",
    "mla_layer_spec",
]
