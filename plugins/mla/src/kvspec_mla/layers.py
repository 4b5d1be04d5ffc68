"""Turning ``mla_attention`` (and ``sliding_mla_attention``) model layers into specs.

The latent is ``kv_lora_rank + qk_rope_head_dim`` values per token (576 for DeepSeek-V2/V3),
one "head" shared by every attention head. Tensor parallelism replicates it rather than
sharding it, so every rank holds the whole latent (``max_tp_shards=1``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvspec_core.errors import ConfigError
from kvspec_core.kv_dtypes import BUILTIN_KV_CACHE_DTYPES, KVCacheDtype, KVQuantMode
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_mla.formats import MLA_KV_DTYPES, is_ds_mla_format
from kvspec_mla.sliding import SlidingWindowMLASpec
from kvspec_mla.specs import MLAAttentionSpec

#: Normalised layer types this family claims.
MLA_LAYER_TYPE = "mla_attention"
SLIDING_MLA_LAYER_TYPE = "sliding_mla_attention"
#: Config fields giving the latent's two parts.
LATENT_FIELDS = ("kv_lora_rank", "qk_rope_head_dim")
#: Config field giving a sliding MLA layer's window.
WINDOW_FIELD = "sliding_window"

_KNOWN_KV_DTYPES: dict[str, KVCacheDtype] = {
    name: kv_dtype
    for kv_dtype in (*BUILTIN_KV_CACHE_DTYPES, *MLA_KV_DTYPES)
    for name in (kv_dtype.name, *kv_dtype.aliases)
}


def latent_size(layer: LayerConfig) -> int:
    """Values of one token's latent: ``kv_lora_rank + qk_rope_head_dim``."""
    rank = layer.positive_int("kv_lora_rank", "compressed KV latent values per token")
    rope = layer.positive_int("qk_rope_head_dim", "RoPE key values per token")
    return rank + rope


def cache_storage(layer: LayerConfig) -> tuple[torch.dtype, KVQuantMode, str | None]:
    """Storage dtype, quant mode and packed-format name of ``layer``'s latent cache.

    A packed ``*_ds_mla`` format is stored as raw bytes and named in ``cache_dtype_str``;
    otherwise the core's resolved attention dtype is used, or, when the core resolved none,
    the requested KV-cache dtype applied to the model's dtype.
    """
    name = layer.options.kv_cache_dtype
    if is_ds_mla_format(name):
        kv_dtype = _KNOWN_KV_DTYPES.get(name)
        if kv_dtype is None:
            raise ConfigError(
                f"layer {layer.name}: KV-cache dtype {name!r} is not a known packed MLA format; "
                f"known: {sorted(n for n in _KNOWN_KV_DTYPES if is_ds_mla_format(n))}"
            )
        return kv_dtype.resolve_storage(layer.model_dtype), kv_dtype.quant_mode, name
    if layer.attention is not None:
        return layer.attention.dtype, layer.attention.kv_quant_mode, None
    kv_dtype = _KNOWN_KV_DTYPES.get(name)
    if kv_dtype is None:
        raise ConfigError(
            f"layer {layer.name}: KV-cache dtype {name!r} is unknown to kvspec-mla and the core "
            f"resolved no attention dtype for this layer; use one of {sorted(_KNOWN_KV_DTYPES)}"
        )
    return kv_dtype.resolve_storage(layer.model_dtype), kv_dtype.quant_mode, None


def mla_fields(layer: LayerConfig) -> dict[str, Any]:
    """The fields every MLA spec of ``layer`` shares."""
    dtype, quant_mode, cache_dtype_str = cache_storage(layer)
    return dict(
        block_size=layer.options.block_size,
        num_kv_heads=1,
        head_size=latent_size(layer),
        dtype=dtype,
        kv_quant_mode=quant_mode,
        cache_dtype_str=cache_dtype_str,
        # The latent is replicated on every TP rank, never split.
        max_tp_shards=1,
    )


def mla_layer_spec(layer: LayerConfig) -> MLAAttentionSpec | SlidingWindowMLASpec | None:
    """The spec of an MLA layer, or ``None`` for a layer of another family."""
    if layer.layer_type == MLA_LAYER_TYPE:
        return MLAAttentionSpec(**mla_fields(layer))
    if layer.layer_type == SLIDING_MLA_LAYER_TYPE:
        window = layer.positive_int(WINDOW_FIELD, "tokens each query attends to")
        return SlidingWindowMLASpec(sliding_window=window, **mla_fields(layer))
    return None
