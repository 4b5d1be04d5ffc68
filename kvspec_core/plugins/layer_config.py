"""What a family plugin sees of one model layer when it turns it into a spec: part of the
plugin contract (``from kvspec_core.plugins import LayerConfig``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch

from kvspec_core.kv_dtypes import NO_QUANT, KVQuantMode
from kvspec_core.validation import MAX_FIELD_VALUE, instance_of, is_bool, positive_int


@attrs.frozen(kw_only=True)
class PlanOptions:
    """The user's choices when turning a model config into layer specs.

    Attributes:
        block_size: tokens per block requested for attention layers (never inflated).
        kv_cache_dtype: a registered KV-cache dtype name (``auto`` takes the model's dtype).
        tensor_parallel_size: TP ranks; KV heads and state heads are divided across them.
        decode_context_parallel_size: DCP ranks; attention token positions are sharded.
    """

    block_size: int = attrs.field(default=16, validator=positive_int)
    kv_cache_dtype: str = attrs.field(default="auto", validator=instance_of(str, "expected a str"))
    tensor_parallel_size: int = attrs.field(default=1, validator=positive_int)
    decode_context_parallel_size: int = attrs.field(default=1, validator=positive_int)


@attrs.frozen(kw_only=True)
class AttentionShape:
    """The attention geometry of a layer on one TP rank, resolved by the core.

    Attributes:
        num_kv_heads: KV heads this rank holds (at least 1; replicated when TP > KV heads).
        total_kv_heads: KV heads of the model; distinct shards across TP.
        head_size / head_size_v: K and V head sizes.
        dtype: cache storage dtype after resolving ``--kv-cache-dtype``.
        kv_quant_mode: the quant mode of that KV-cache dtype.
        kv_cache_dtype: the KV-cache dtype name the user asked for.
        replicated: whether TP ranks beyond ``total_kv_heads`` hold replicas.
    """

    num_kv_heads: int = attrs.field(validator=positive_int)
    total_kv_heads: int = attrs.field(validator=positive_int)
    head_size: int = attrs.field(validator=positive_int)
    head_size_v: int = attrs.field(validator=positive_int)
    dtype: torch.dtype = attrs.field(validator=instance_of(torch.dtype, "expected a torch.dtype"))
    kv_quant_mode: KVQuantMode = NO_QUANT
    kv_cache_dtype: str = "auto"
    replicated: bool = attrs.field(default=False, validator=is_bool)


@attrs.frozen(kw_only=True, eq=False)
class LayerConfig:
    """One layer of a model config, as handed to ``kvspec_layer_spec`` hooks.

    Attributes:
        index: position of the layer in the model (0-based).
        name: the layer's name in the plan (``model.layers.3``).
        layer_type: the core's normalised type: ``full_attention``, ``sliding_attention``,
            ``chunked_attention``, ``mla_attention``, ``linear_attention``, ``mamba``,
            ``cross_attention``, ``encoder_only``, or a ``layer_types`` value passed through
            unchanged for third-party families.
        config: the (text) model config, as parsed from ``config.json``.
        options: the user's planning options.
        model_dtype: the model's dtype (``torch_dtype`` / ``dtype`` of the config).
        attention: resolved attention geometry, or ``None`` when the config has none.
    """

    index: int
    name: str
    layer_type: str
    config: Mapping[str, Any]
    options: PlanOptions
    model_dtype: torch.dtype
    attention: AttentionShape | None = None

    def attention_spec_fields(self) -> dict[str, Any]:
        """Keyword arguments every ``AttentionSpec`` of this layer shares: block size, heads,
        head sizes, dtype, quant mode and TP shards; refused when the config has no geometry."""
        shape = self.attention
        if shape is None:
            from kvspec_core.errors import ConfigError

            raise ConfigError(
                f"layer {self.name} is a {self.layer_type} layer but the config gives no "
                "attention geometry (num_key_value_heads / head_dim); fix the model config"
            )
        return dict(
            block_size=self.options.block_size,
            num_kv_heads=shape.num_kv_heads,
            head_size=shape.head_size,
            head_size_v=shape.head_size_v,
            dtype=shape.dtype,
            kv_quant_mode=shape.kv_quant_mode,
            max_tp_shards=shape.total_kv_heads,
        )

    def positive_int(self, field: str, meaning: str, fix: str = "Fix the model config") -> int:
        """Config ``field`` as an int in ``[1, MAX_FIELD_VALUE]``; anything else (missing,
        bool, float, out of range) is a ConfigError naming the layer, the field, its value,
        what it means and ``fix``."""
        value = self.config.get(field)
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 0 < value <= MAX_FIELD_VALUE
        ):
            from kvspec_core.errors import ConfigError

            raise ConfigError(
                f"layer {self.name} is a {self.layer_type} layer but config field {field!r} is "
                f"{value!r}; it must be a positive int ({meaning}). {fix}"
            )
        return value

    def get(self, *keys: str, default: Any = None) -> Any:
        """The first of ``keys`` present (and not ``None``) in the config, else ``default``."""
        for key in keys:
            value = self.config.get(key)
            if value is not None:
                return value
        return default
