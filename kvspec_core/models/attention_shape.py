"""Resolving a layer's attention geometry on one tensor-parallel rank.

Head size comes from ``head_dim`` (or ``attention_head_dim``), else ``hidden_size //
num_attention_heads``; KV heads as vLLM reads them (Falcon's ``multi_query`` and ``n_head_kv``,
``num_kv_heads``, ``num_key_value_heads``, ChatGLM's ``multi_query_group_num``), else
``num_attention_heads`` (no grouped-query attention); DBRX's and MPT's from
``attn_config.kv_n_heads``. MLA layers (``kv_lora_rank``) cache one latent of
``kv_lora_rank + qk_rope_head_dim`` values per token, shared by every head: the shape is one
KV head of that width (``head_size == head_size_v``; the MLA plugin decides how the latent is
stored) and, having a single head, it is replicated across TP ranks.

Tensor parallelism: each rank holds ``total // tp`` KV heads. When ``tp`` exceeds the KV
heads, each rank holds one head and ranks share replicas (``replicated``), as engines do;
that needs ``tp`` to be a multiple of the heads. Any other split is refused naming the field.

Packed MLA cache formats (``*_ds_mla``: one latent record of NoPE values, RoPE values and
scales per token) exist only for MLA layers; asking for one on any other attention layer is
refused rather than sized as one byte per K/V element.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvspec_core.errors import ConfigError
from kvspec_core.kv_dtypes import KVCacheDtype
from kvspec_core.models.fields import first_present, int_field, missing_field, require_int
from kvspec_core.models.head_fields import DECODER_ONLY_FIELDS, HeadFields
from kvspec_core.models.layer_typing import MLA_ATTENTION, SLIDING_MLA_ATTENTION
from kvspec_core.plugins.layer_config import AttentionShape
from kvspec_core.validation import MAX_FIELD_VALUE

#: Name suffix of the packed DeepSeek MLA cache formats (``fp8_ds_mla``, ``nvfp4_ds_mla``).
PACKED_MLA_SUFFIX = "_ds_mla"


def _present_name(config: Mapping[str, Any], names: tuple[str, ...]) -> str:
    found = first_present(config, *names)
    return found[0] if found is not None else names[0]


def _head_size(config: Mapping[str, Any], fields: HeadFields, where: str) -> int:
    if first_present(config, *fields.head_dim) is not None:
        return require_int(config, *fields.head_dim, needed_for=where)
    heads = require_int(config, *fields.heads, needed_for=where)
    hidden = require_int(config, *fields.hidden, needed_for=where)
    if hidden % heads:
        # Name the spellings this config uses (hidden_size / d_model / n_embd...).
        hidden_field = _present_name(config, fields.hidden)
        heads_field = _present_name(config, fields.heads)
        raise ConfigError(
            f"config field {hidden_field!r}={hidden} is not a multiple of "
            f"{heads_field!r}={heads} ({where}), so the head size is unknown; add "
            f"{fields.head_dim[0]!r} to the model config"
        )
    return hidden // heads


#: Falcon's model types: without the new decoder architecture, ``multi_query`` means one KV
#: head whatever the head fields say (FalconAttention; vLLM's get_total_num_kv_heads).
_FALCON_TYPES = frozenset({"falcon", "RefinedWeb", "RefinedWebModel"})
#: Model types whose KV heads are ``attn_config.kv_n_heads`` (else their attention heads).
_ATTN_CONFIG_KV_TYPES = frozenset({"dbrx", "mpt"})

#: Fields of layouts whose per-layer K/V widths kvspec does not read: planned from the
#: shared fields, their caches would be sized wrongly (found by review, against
#: transformers' model code). Gemma-4 sizes its global layers from ``global_head_dim`` and
#: ``num_global_key_value_heads``.
_PER_LAYER_HEAD_FIELDS = ("global_head_dim", "num_global_key_value_heads", "per_layer_config")


def _refuse_unread_head_fields(config: Mapping[str, Any], fields: HeadFields, where: str) -> None:
    """Refuse configs whose K/V widths come from fields the shared lookup does not read."""
    for name in _PER_LAYER_HEAD_FIELDS:
        if config.get(name) is not None:
            raise ConfigError(
                f"config field {name!r} ({where}): this model sizes some layers' K/V heads "
                "from their own fields (Gemma-4's global layers), which kvspec does not read "
                "yet; planned from the shared head fields its cache would be sized wrongly"
            )
    # A V width other than K's outside MLA (MiMo-V2-Flash): every K/V cache here holds
    # head_size values for each, so a different v_head_dim would be sized wrongly.
    v_width = config.get("v_head_dim")
    if v_width is not None and "kv_lora_rank" not in config:
        head = _head_size(config, fields, where)
        if v_width != head:
            raise ConfigError(
                f"config field 'v_head_dim'={v_width!r} differs from the head size {head} "
                f"({where}) outside MLA: kvspec sizes V like K, so this model's cache would "
                "be sized wrongly; it is not supported yet"
            )
    # kv_channels is the per-head width of ChatGLM and JetMoE; where it differs from the
    # derived head size and head_dim does not settle it, the width is ambiguous.
    channels = config.get("kv_channels")
    if channels is not None and first_present(config, *fields.head_dim) is None:
        heads, hidden = first_present(config, *fields.heads), first_present(config, *fields.hidden)
        derived = (
            hidden[1] // heads[1]
            if heads
            and hidden
            and isinstance(heads[1], int)
            and isinstance(hidden[1], int)
            and heads[1] > 0
            else None
        )
        if channels != derived:
            raise ConfigError(
                f"config field 'kv_channels'={channels!r} differs from hidden size / attention "
                f"heads = {derived} ({where}), and no 'head_dim' says which is the K/V head "
                "size; add 'head_dim' to the model config"
            )


def _total_kv_heads(config: Mapping[str, Any], fields: HeadFields, where: str) -> tuple[str, int]:
    if (
        config.get("model_type") in _FALCON_TYPES
        and not config.get("new_decoder_architecture")
        and config.get("multi_query")
    ):
        return "multi_query", 1
    attn_config = config.get("attn_config")
    if (
        config.get("model_type") in _ATTN_CONFIG_KV_TYPES
        and isinstance(attn_config, Mapping)
        and attn_config.get("kv_n_heads") is not None
    ):
        # DBRX's and MPT's KV heads sit in their attention sub-config (vLLM reads them there).
        field = "attn_config.kv_n_heads"
        return field, int_field(config, field, attn_config["kv_n_heads"], needed_for=where)
    if config.get("multi_query_attention") is False and "multi_query_group_num" in config:
        # ChatGLM with multi-query attention off: every query head has its own K/V.
        found = first_present(config, *fields.heads)
        if found is not None:
            return found[0], int_field(config, found[0], found[1], needed_for=where)
    found = first_present(config, *fields.kv_heads)
    if found is not None:
        field, value = found
        return field, int_field(config, field, value, needed_for=where)
    found = first_present(config, *fields.heads)
    if found is None:
        raise missing_field(
            *fields.kv_heads,
            *fields.heads,
            needed_for=where,
            fix="add the number of KV heads to the model config",
        )
    field, value = found
    return field, int_field(config, field, value, needed_for=where)


def check_given_head_fields(config: Mapping[str, Any]) -> None:
    """Refuse a decoder head field (heads, KV heads, head size, hidden size) that the config
    gives but that is no int in kvspec's range, naming it: what the layers are sized from
    must be usable before anything is built from it."""
    fields = DECODER_ONLY_FIELDS
    for name in (*fields.heads, *fields.kv_heads, *fields.head_dim, *fields.hidden):
        value = config.get(name)
        if value is not None:
            int_field(config, name, value, needed_for="the attention layers' shape")


def declared_kv_heads(config: Mapping[str, Any]) -> tuple[str, int] | None:
    """``(field, total KV heads)`` of a decoder-only ``config``, read as vLLM reads them
    (Falcon's ``multi_query``, ``n_head_kv``, ..., ChatGLM's ``multi_query_group_num``, else
    the attention heads), or None where the config gives no valid count (the plan's own
    checks then name the field)."""
    try:
        return _total_kv_heads(config, DECODER_ONLY_FIELDS, "the model")
    except ConfigError:
        return None


def _divisors(value: int) -> list[int]:
    """Divisors of ``value`` in ascending order, in O(sqrt(value)) steps: a hostile head count
    near the field limit must not stall the error message that lists them."""
    small: list[int] = []
    large: list[int] = []
    candidate = 1
    while candidate * candidate <= value:
        if value % candidate == 0:
            small.append(candidate)
            if candidate * candidate != value:
                large.append(value // candidate)
        candidate += 1
    return small + large[::-1]


def kv_heads_per_rank(total: int, tp: int, field: str, where: str) -> tuple[int, bool]:
    """(KV heads one rank holds, whether ranks hold replicas) for ``total`` heads at ``tp``."""
    if tp <= total:
        if total % tp:
            divisors = _divisors(total)
            raise ConfigError(
                f"config field {field!r}={total} ({where}) cannot be split evenly across "
                f"tensor parallel size {tp}; use a --tp that divides {total} "
                f"({', '.join(map(str, divisors))}) or a multiple of it"
            )
        return total // tp, False
    if tp % total:
        raise ConfigError(
            f"tensor parallel size {tp} exceeds config field {field!r}={total} ({where}) and is "
            f"not a multiple of it, so KV heads cannot be replicated evenly; use a --tp that is "
            f"a multiple of {total} or at most {total}"
        )
    return 1, True


def _mla_latent_width(config: Mapping[str, Any], where: str) -> int:
    rank = require_int(config, "kv_lora_rank", needed_for=where)
    rope = require_int(config, "qk_rope_head_dim", needed_for=where, minimum=0)
    if rank + rope > MAX_FIELD_VALUE:
        raise ConfigError(
            f"config fields 'kv_lora_rank' + 'qk_rope_head_dim' = {rank} + {rope} ({where}) "
            f"exceed the limit of {MAX_FIELD_VALUE} latent values per token; fix them in the "
            "model config"
        )
    return rank + rope


def _query_heads(
    config: Mapping[str, Any], fields: HeadFields, where: str
) -> tuple[str, int] | None:
    """The layer's query-head field and count, None when the config names none."""
    found = first_present(config, *fields.heads)
    if found is None:
        return None
    return found[0], int_field(config, found[0], found[1], needed_for=where)


def _check_query_groups(
    config: Mapping[str, Any], fields: HeadFields, kv_field: str, kv_heads: int, where: str
) -> None:
    """Refuse KV heads that do not divide the query heads: every KV head serves a whole
    group of them (grouped-query attention), so such a config describes no model (vLLM's
    attention asserts it) and its cache size would be a guess."""
    found = _query_heads(config, fields, where)
    if found is None or found[0] == kv_field:
        return
    field, heads = found
    if heads % kv_heads:
        raise ConfigError(
            f"config field {kv_field!r}={kv_heads} does not divide {field!r}={heads} "
            f"({where}): each KV head serves a whole group of query heads; fix the model "
            "config"
        )


def check_decode_context_parallel(
    config: Mapping[str, Any],
    fields: HeadFields,
    *,
    is_mla: bool,
    total_kv_heads: int,
    kv_field: str,
    tp: int,
    dcp: int,
    where: str,
) -> None:
    """Refuse a DCP size the layer's cache cannot be split by, as vLLM does: DCP reuses the
    TP ranks (it must divide TP), and splits a request's tokens among ranks that hold the
    *same* KV heads. An MLA latent is on every rank; GQA/MQA heads are replicated only when
    TP exceeds them, ``TP / KV heads`` times, and the query heads of a KV head must split
    too. Planned anyway, each rank would hold ``1 / dcp`` of tokens no other rank holds."""
    if dcp == 1:
        return
    if tp % dcp:
        raise ConfigError(
            f"decode context parallel size {dcp} does not divide tensor parallel size {tp} "
            f"(DCP reuses the TP ranks); use a --dcp that divides {tp}"
        )
    if is_mla:
        return
    if tp <= total_kv_heads:
        raise ConfigError(
            f"decode context parallelism splits tokens among TP ranks holding the same KV "
            f"heads, but at tensor parallel size {tp} each of config field "
            f"{kv_field!r}={total_kv_heads} ({where}) is held once: use a --tp above "
            f"{total_kv_heads} (a multiple of it), or --dcp 1"
        )
    replicas = tp // total_kv_heads
    if dcp > replicas:
        raise ConfigError(
            f"decode context parallel size {dcp} exceeds the {replicas} TP ranks that hold each "
            f"KV head (tensor parallel size {tp}, {kv_field!r}={total_kv_heads}, {where}); use "
            f"a --dcp of at most {replicas}"
        )
    found = _query_heads(config, fields, where)
    if found is None:
        return
    field, heads = found
    per_kv_head = heads // total_kv_heads
    if per_kv_head % dcp:
        raise ConfigError(
            f"the {per_kv_head} query heads of each KV head ({field!r}={heads} over "
            f"{kv_field!r}={total_kv_heads}, {where}) do not split across decode context "
            f"parallel size {dcp}; use a --dcp that divides {per_kv_head}"
        )


def resolve_attention_shape(
    config: Mapping[str, Any],
    layer_type: str,
    *,
    fields: HeadFields,
    tensor_parallel_size: int,
    kv_dtype: KVCacheDtype,
    kv_cache_dtype: str,
    model_dtype: torch.dtype,
    where: str,
    decode_context_parallel_size: int = 1,
) -> AttentionShape:
    """The :class:`AttentionShape` one TP rank holds for a layer of ``layer_type``
    (refusing a ``decode_context_parallel_size`` it cannot be split by:
    :func:`check_decode_context_parallel`).

    ``where`` names the layer for error messages (``layer model.layers.3 (full_attention)``).
    """
    is_mla = layer_type in (MLA_ATTENTION, SLIDING_MLA_ATTENTION)
    if not is_mla and kv_dtype.name.endswith(PACKED_MLA_SUFFIX):
        raise ConfigError(
            f"KV-cache dtype {kv_cache_dtype!r} is a packed MLA latent format, but {where} is "
            "not an MLA layer (the config has no 'kv_lora_rank'); choose a K/V cache dtype "
            "such as 'auto', 'fp8' or 'nvfp4'"
        )
    if is_mla:
        kv_field, total = "kv_lora_rank", 1
        head_size = head_size_v = _mla_latent_width(config, where)
    else:
        _refuse_unread_head_fields(config, fields, where)
        kv_field, total = _total_kv_heads(config, fields, where)
        _check_query_groups(config, fields, kv_field, total, where)
        head_size = head_size_v = _head_size(config, fields, where)
    per_rank, replicated = kv_heads_per_rank(total, tensor_parallel_size, kv_field, where)
    check_decode_context_parallel(
        config,
        fields,
        is_mla=is_mla,
        total_kv_heads=total,
        kv_field=kv_field,
        tp=tensor_parallel_size,
        dcp=decode_context_parallel_size,
        where=where,
    )
    return AttentionShape(
        num_kv_heads=per_rank,
        total_kv_heads=total,
        head_size=head_size,
        head_size_v=head_size_v,
        dtype=kv_dtype.resolve_storage(model_dtype),
        kv_quant_mode=kv_dtype.quant_mode,
        kv_cache_dtype=kv_cache_dtype,
        replicated=replicated,
    )
