"""DeepSeek's packed MLA cache formats (``*_ds_mla``): bytes one token's latent takes.

These formats are opaque byte records written by FlashMLA-style kernels, so their size is not
``values x dtype bytes``; it is a published constant of the layout. Each entry names the
geometry it was published for (latent values per token and the model version), and a spec
whose geometry differs is refused rather than sized with a number nobody published.
"""

from __future__ import annotations

import attrs
import torch

from kvspec_core.errors import InvalidFieldError
from kvspec_core.kv_dtypes import (
    BUILTIN_KV_CACHE_DTYPES,
    BUILTIN_QUANT_MODES,
    KVCacheDtype,
    KVQuantMode,
)

#: Suffix of every packed DeepSeek MLA cache dtype name.
DS_MLA_SUFFIX = "_ds_mla"
#: Model versions an MLA spec may declare (``None``: DeepSeek-V2/V3/V3.2 geometry).
MODEL_VERSIONS = (None, "deepseek_v4")

_SOURCE = (
    "vllm-project/vllm vllm/v1/attention/backends/mla/flashmla_sparse.py "
    "(commit 008a0c31dc020099dd40e8a2b7d2bdb37699b047), layout notes"
)


@attrs.frozen(kw_only=True)
class DSMLAFormat:
    """One published packed-cache record.

    Attributes:
        name: the cache dtype string (``fp8_ds_mla``).
        model_version: the model version the record belongs to.
        latent_values: values per token the record encodes (``head_size`` of the spec).
        bytes_per_token: bytes of one token's record.
        layout: what the bytes hold, for error messages and docs.
    """

    name: str
    model_version: str | None
    latent_values: int
    bytes_per_token: int
    layout: str


#: Every packed record whose size has been published, keyed by (name, model version).
DS_MLA_FORMATS: dict[tuple[str, str | None], DSMLAFormat] = {
    (fmt.name, fmt.model_version): fmt
    for fmt in (
        DSMLAFormat(
            name="fp8_ds_mla",
            model_version=None,
            latent_values=576,
            bytes_per_token=656,
            layout="512 float8_e4m3 NoPE values + 4 float32 scales + 64 bfloat16 RoPE values",
        ),
        DSMLAFormat(
            name="fp8_ds_mla",
            model_version="deepseek_v4",
            latent_values=512,
            bytes_per_token=584,
            layout="448 float8_e4m3 NoPE values + 64 bfloat16 RoPE values + 7 ue8m0 scales "
            "+ 1 pad byte",
        ),
        DSMLAFormat(
            name="nvfp4_ds_mla",
            model_version=None,
            latent_values=576,
            bytes_per_token=352,
            layout="512 e2m1 NoPE values packed 2 per byte + 64 float8_e4m3 RoPE values "
            "+ 32 float8_e4m3 scales (one per 16 NoPE values)",
        ),
    )
}


def is_ds_mla_format(cache_dtype_str: str | None) -> bool:
    """Whether ``cache_dtype_str`` names a packed DeepSeek MLA record."""
    return cache_dtype_str is not None and cache_dtype_str.endswith(DS_MLA_SUFFIX)


def ds_mla_format(
    owner: str, cache_dtype_str: str, model_version: str | None, head_size: int
) -> DSMLAFormat:
    """The published record for ``cache_dtype_str`` at this geometry; refuses, naming the
    field and the published geometries, when none was published."""
    known = sorted(
        f"{fmt.name} (model_version={fmt.model_version!r}, head_size={fmt.latent_values}: "
        f"{fmt.bytes_per_token} B/token)"
        for fmt in DS_MLA_FORMATS.values()
    )
    fmt = DS_MLA_FORMATS.get((cache_dtype_str, model_version))
    if fmt is None:
        raise InvalidFieldError(
            owner,
            "cache_dtype_str",
            cache_dtype_str,
            f"no byte size is published for this packed MLA record with model_version="
            f"{model_version!r}; published: {'; '.join(known)}. Pass the backend's record size "
            "as state_content_bytes, or choose a published format",
        )
    if head_size != fmt.latent_values:
        raise InvalidFieldError(
            owner,
            "head_size",
            head_size,
            f"cache_dtype_str={cache_dtype_str!r} (model_version={model_version!r}) packs "
            f"{fmt.latent_values} latent values per token ({fmt.layout}); give head_size="
            f"{fmt.latent_values}, or pass the backend's record size as state_content_bytes",
        )
    return fmt


#: KV-cache dtype names the MLA formats need that the core does not already register.
#: ``fp8_ds_mla`` is stored as raw bytes; like the reference engine, its quant mode is
#: per-tensor fp8 (the page size comes from the record, not from the quant mode).
_FP8_PER_TENSOR: KVQuantMode = next(
    mode for mode in BUILTIN_QUANT_MODES if mode.name == "fp8_per_tensor"
)
_MLA_KV_DTYPES = (
    KVCacheDtype(name="fp8_ds_mla", storage_dtype=torch.uint8, quant_mode=_FP8_PER_TENSOR),
)
_CORE_NAMES = {
    name for kv_dtype in BUILTIN_KV_CACHE_DTYPES for name in (kv_dtype.name, *kv_dtype.aliases)
}
MLA_KV_DTYPES: tuple[KVCacheDtype, ...] = tuple(
    kv_dtype for kv_dtype in _MLA_KV_DTYPES if kv_dtype.name not in _CORE_NAMES
)
