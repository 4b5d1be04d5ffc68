"""vLLM's per-layer KV-cache specs read as kvspec specs, and kvspec's groups written back.

The translation is by exact class: a subclass of vLLM's ``FullAttentionSpec`` (R-SWA,
hidden-state caches, ...) carries meaning the parent's fields do not, so a class without
its own entry in :data:`SPEC_CLASSES` is refused rather than planned as plain full
attention. A quantised cache takes kvspec's quant mode of the same name (vLLM's
``KVQuantMode.FP8_PER_TENSOR`` is kvspec's ``fp8_per_tensor``); every translated layer's
page must come out at vLLM's size to the byte. A refusal raises
:class:`~kvspec_vllm.errors.NotRepresentable` naming the layer and the class.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from kvspec_core.kv_dtypes import BUILTIN_QUANT_MODES, KVQuantMode
from kvspec_core.specs.base import KVSpec
from kvspec_core.specs.uniform import UniformTypeSpecs
from kvspec_vllm.errors import NotRepresentable

#: Fields every vLLM ``AttentionSpec`` shares with kvspec's ``AttentionSpec``.
ATTENTION_FIELDS = (
    "block_size",
    "dcp_sharded",
    "max_tp_shards",
    "num_kv_heads",
    "head_size",
    "dtype",
    "head_size_v",
    "page_size_padded",
    "num_head_slots",
    "state_content_bytes",
    "tokens_per_state",
)

#: vLLM's Mamba backends -> kvspec's ``mamba_type``.
MAMBA_TYPES: Mapping[str, str] = {
    "MAMBA1": "mamba1",
    "MAMBA2": "mamba2",
    "SHORT_CONV": "short_conv",
    "LINEAR": "linear_attention",
    "GDN_ATTN": "gated_delta_net",
}

#: Fields vLLM's ``MambaSpec`` shares with kvspec's (``page_size_padded`` is read, then
#: dropped: see :func:`kvspec_spec_of`).
MAMBA_FIELDS = (
    "block_size",
    "shapes",
    "dtypes",
    "page_size_padded",
    "num_speculative_blocks",
    "num_prefill_checkpoint_blocks",
    "prefill_checkpoint_alignment",
    "tp_replicated",
)

#: Fields of vLLM's ``FullAttentionSpec`` beyond the attention ones.
FULL_ATTENTION_FIELDS = ("sliding_window", "attention_chunk_size", "non_causal")

#: kvspec's quant modes by name (vLLM's ``KVQuantMode`` member names, lower-cased, are the
#: same names).
QUANT_MODES: Mapping[str, KVQuantMode] = {mode.name: mode for mode in BUILTIN_QUANT_MODES}

#: vLLM class name -> (kvspec module, class, fields beyond the attention ones).
SPEC_CLASSES: Mapping[str, tuple[str, str, tuple[str, ...]]] = {
    "FullAttentionSpec": (
        "kvspec_core.specs.full_attention",
        "FullAttentionSpec",
        FULL_ATTENTION_FIELDS,
    ),
    "SinkFullAttentionSpec": (
        "kvspec_core.specs.full_attention",
        "SinkFullAttentionSpec",
        (*FULL_ATTENTION_FIELDS, "sink_len"),
    ),
    "CrossAttentionSpec": ("kvspec_core.specs.encoder", "CrossAttentionSpec", ()),
    "MLAAttentionSpec": (
        "kvspec_mla.specs",
        "MLAAttentionSpec",
        (
            *FULL_ATTENTION_FIELDS,
            "cache_dtype_str",
            "alignment",
            "model_version",
            "cache_role",
            "is_index_group_leader",
            "non_causal_multi_token_decode",
        ),
    ),
    "SlidingWindowSpec": (
        "kvspec_sliding_window.specs",
        "SlidingWindowSpec",
        ("sliding_window", "extra_retained_tokens"),
    ),
    "ChunkedLocalAttentionSpec": (
        "kvspec_chunked_local.specs",
        "ChunkedLocalAttentionSpec",
        ("attention_chunk_size",),
    ),
}


def vllm_module(name: str) -> Any:
    """A vLLM module, imported on use (vLLM is not a dependency of this package)."""
    return importlib.import_module(name)


def kvspec_spec_of(layer: str, spec: Any) -> KVSpec:
    """kvspec's spec for vLLM's ``spec`` of ``layer``; refuses what has no translation."""
    interface = vllm_module("vllm.v1.kv_cache_interface")
    name = type(spec).__name__
    if type(spec) is interface.MambaSpec:
        return _mamba_spec_of(layer, spec)
    target = SPEC_CLASSES.get(name)
    if target is None or type(spec) is not getattr(interface, name, None):
        raise NotRepresentable(
            f"layer {layer!r} has vLLM spec {type(spec).__module__}.{name}, which kvspec-vllm "
            f"does not translate (it translates {', '.join(SPEC_CLASSES)})"
        )
    module_name, class_name, extra = SPEC_CLASSES[name]
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as error:
        raise NotRepresentable(
            f"layer {layer!r} needs {module_name} for vLLM's {name} ({error}); install the "
            "kvspec family plugin that provides it"
        ) from error
    fields = {field: _plain(getattr(spec, field)) for field in (*ATTENTION_FIELDS, *extra)}
    fields["kv_quant_mode"] = _quant_mode_of(layer, spec.kv_quant_mode)
    alignment = spec.get_block_stride_alignment()
    fields["block_stride_alignment"] = alignment if alignment > 1 else None
    try:
        translated: KVSpec = cls(**fields)
    except (TypeError, ValueError) as error:
        raise NotRepresentable(
            f"layer {layer!r}: kvspec refuses vLLM's {name} fields {fields}: {error}"
        ) from error
    if translated.page_size_bytes != spec.page_size_bytes:
        raise NotRepresentable(
            f"layer {layer!r}: kvspec sizes vLLM's {name} page at "
            f"{translated.page_size_bytes} bytes, vLLM at {spec.page_size_bytes}"
        )
    return translated


def _plain(value: Any) -> Any:
    """A vLLM enum field (``SparseCacheRole.SPARSE``) as the string kvspec's field takes."""
    return value.value if isinstance(value, enum.Enum) else value


def _quant_mode_of(layer: str, vllm_mode: Any) -> KVQuantMode:
    """kvspec's quant mode named as vLLM's ``KVQuantMode`` member (the page-size check after
    the translation proves the two size a page alike)."""
    mode = QUANT_MODES.get(vllm_mode.name.lower())
    if mode is None:
        raise NotRepresentable(
            f"layer {layer!r} has vLLM's KV quant mode {vllm_mode.name}, which kvspec does not "
            f"know (it knows {', '.join(sorted(QUANT_MODES))})"
        )
    return mode


def _mamba_spec_of(layer: str, spec: Any) -> KVSpec:
    mamba_type = MAMBA_TYPES.get(spec.mamba_type.name)
    if mamba_type is None:
        raise NotRepresentable(
            f"layer {layer!r} has Mamba backend {spec.mamba_type.name}, which kvspec-vllm does "
            f"not map (it maps {', '.join(MAMBA_TYPES)})"
        )
    try:
        from kvspec_mamba.specs import MambaSpec
    except ImportError as error:
        raise NotRepresentable(
            f"layer {layer!r} is a Mamba layer and kvspec-mamba is not installed ({error})"
        ) from error
    fields = {field: getattr(spec, field) for field in MAMBA_FIELDS}
    # vLLM pads a state page to the attention page (and inflates the attention block size)
    # so that one block pool holds both; kvspec plans the state as it is, in its own pool.
    fields["page_size_padded"] = None
    fields["shapes"] = tuple(tuple(shape) for shape in fields["shapes"])
    fields["dtypes"] = tuple(fields["dtypes"])
    return MambaSpec(mamba_type=mamba_type, **fields)


def vllm_group_spec(
    kvspec_group_spec: KVSpec, layers: Sequence[str], vllm_specs: Mapping[str, Any]
) -> Any:
    """vLLM's group spec for a kvspec group over ``layers``: a uniform-type wrapper where
    kvspec made one, else the layers' one vLLM spec (merged by vLLM's own rule when the
    layers' specs differ in fields a merge reconciles)."""
    interface = vllm_module("vllm.v1.kv_cache_interface")
    specs = [vllm_specs[layer] for layer in layers]
    if isinstance(kvspec_group_spec, UniformTypeSpecs):
        return interface.UniformTypeKVCacheSpecs(
            block_size=kvspec_group_spec.block_size,
            kv_cache_specs={layer: vllm_specs[layer] for layer in layers},
        )
    if all(spec == specs[0] for spec in specs):
        return specs[0]
    if len({type(spec) for spec in specs}) == 1:
        return type(specs[0]).merge(specs)
    raise NotRepresentable(
        f"kvspec grouped layers {list(layers)} whose vLLM specs differ and vLLM cannot merge"
    )
