"""Sizing a model's Mamba / linear-attention layer state as the published model code does.

Three layouts are recognised from the config's fields (TP rank shares in parentheses):

* Mamba-1 (Jamba: ``mamba_d_state``, ``mamba_d_conv``, ``mamba_expand``, ``hidden_size``):
  conv ``(d_conv - 1, I/tp)`` and SSM ``(I/tp, d_state)`` with ``I = expand * hidden``.
* Mamba-2 (Nemotron-H ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``,
  ``conv_kernel``, ``n_groups``; Granite-4.0-H / Bamba / Falcon-H1 ``mamba_n_heads``,
  ``mamba_d_head``, ``mamba_d_state``, ``mamba_d_conv``, ``mamba_n_groups``, with
  ``I = mamba_d_ssm`` or ``mamba_expand * hidden_size``): conv
  ``(d_conv - 1, I/tp + 2 * groups_per_rank * d_state)`` and SSM
  ``(heads/tp, head_dim, d_state)``. Groups fewer than the TP ranks are replicated (one per
  rank), as the reference kernels do.
* Gated delta-net (Qwen3-Next ``linear_conv_kernel_dim``, ``linear_key_head_dim``,
  ``linear_num_key_heads``, ``linear_num_value_heads``, ``linear_value_head_dim``): conv
  ``(d_conv - 1, (2 * k_heads * k_dim + v_heads * v_dim)/tp)`` and SSM
  ``(v_heads/tp, k_dim, v_dim)``.
* Lightning linear attention (MiniMax-Text-01, typed by ``attn_type_list``): one state
  ``(num_attention_heads/tp, head_dim, head_dim)`` in the model dtype.

The conv window is stored in the model dtype. The SSM state may use another dtype: the
config's ``mamba_ssm_cache_dtype`` (or ``mamba_ssm_dtype``) when set, else float32 for
Nemotron-H (the reference engine's default there: only float32 is known to keep accuracy),
else the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvspec_core.dtypes import dtype_from_name
from kvspec_core.errors import ConfigError, KVSpecError
from kvspec_core.models.fields import MissingConfigFieldError
from kvspec_core.plugins.layer_config import LayerConfig
from kvspec_core.validation import MAX_FIELD_VALUE
from kvspec_mamba.specs import MambaSpec

#: Normalised layer types this family claims.
STATE_LAYER_TYPES = ("mamba", "linear_attention")
#: Config fields that may name the SSM state dtype.
SSM_DTYPE_FIELDS = ("mamba_ssm_cache_dtype", "mamba_ssm_dtype")
#: SSM state dtype by ``model_type`` when the config names none.
DEFAULT_SSM_DTYPES: dict[str, torch.dtype] = {"nemotron_h": torch.float32}


def _field(layer: LayerConfig, *names: str, minimum: int = 1) -> int:
    """An int config field in ``[minimum, MAX_FIELD_VALUE]`` (the first of ``names``
    present); else a ConfigError."""
    for name in names:
        value = layer.config.get(name)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # some configs write sizes as 2.0
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not minimum <= value <= MAX_FIELD_VALUE
        ):
            allowed = "a positive int" if minimum == 1 else f"an int >= {minimum}"
            raise ConfigError(
                f"layer {layer.name}: config field {name!r} is {value!r}; it must be {allowed}. "
                "Fix the model config"
            )
        return value
    raise MissingConfigFieldError(
        f"layer {layer.name} is a {layer.layer_type} layer but the config has no "
        f"{' / '.join(repr(n) for n in names)}; add it to the config",
        fields=names,
    )


def _per_rank(layer: LayerConfig, field: str, value: int) -> int:
    """``value`` divided across the TP ranks; refused when it does not divide."""
    tp = layer.options.tensor_parallel_size
    if value % tp:
        raise ConfigError(
            f"layer {layer.name}: {field}={value} is not divisible by tensor_parallel_size={tp}; "
            f"choose a TP size that divides {value}"
        )
    return value // tp


def _groups_per_rank(layer: LayerConfig, field: str, groups: int) -> int:
    """B/C groups one rank holds: sharded when TP divides them, else replicated one per rank
    when they divide TP (e.g. a single group), else refused."""
    tp = layer.options.tensor_parallel_size
    if groups % tp == 0:
        return groups // tp
    if tp % groups == 0:
        return 1
    raise ConfigError(
        f"layer {layer.name}: {field}={groups} neither divides nor is divisible by "
        f"tensor_parallel_size={tp}; choose a TP size that divides or is a multiple of {groups}"
    )


def ssm_dtype_of(layer: LayerConfig) -> torch.dtype:
    """The SSM state dtype: the config's choice, the family's default, or the model dtype."""
    for name in SSM_DTYPE_FIELDS:
        value = layer.config.get(name)
        if value is None or value == "auto":
            continue
        if not isinstance(value, str):
            raise ConfigError(
                f"layer {layer.name}: config field {name!r} is {value!r}; it must be a dtype "
                "name such as 'float32' or 'bfloat16'"
            )
        try:
            return dtype_from_name(value)
        except KVSpecError as error:
            raise ConfigError(f"layer {layer.name}: config field {name!r}: {error}") from error
    return DEFAULT_SSM_DTYPES.get(str(layer.config.get("model_type")), layer.model_dtype)


#: Smallest conv kernel: the conv state keeps ``kernel - 1`` past inputs, so a narrower
#: kernel would leave an empty state.
MIN_CONV_KERNEL = 2

#: (mamba_type, state shapes on this TP rank).
StateLayout = tuple[str, tuple[tuple[int, ...], ...]]


def mamba1_state(layer: LayerConfig) -> StateLayout:
    d_state = _field(layer, "mamba_d_state", "state_size")
    d_conv = _field(layer, "mamba_d_conv", "conv_kernel", minimum=MIN_CONV_KERNEL)
    expand = _field(layer, "mamba_expand", "expand")
    hidden = _field(layer, "hidden_size")
    inner = _per_rank(layer, "mamba_expand * hidden_size", expand * hidden)
    return "mamba1", ((d_conv - 1, inner), (inner, d_state))


def mamba2_state(layer: LayerConfig) -> StateLayout:
    heads_field = (
        "mamba_num_heads" if layer.config.get("mamba_num_heads") is not None else "mamba_n_heads"
    )
    heads = _field(layer, heads_field)
    d_state = _field(layer, "ssm_state_size", "mamba_d_state")
    d_conv = _field(layer, "conv_kernel", "mamba_d_conv", minimum=MIN_CONV_KERNEL)
    groups = _field(layer, "n_groups", "mamba_n_groups")
    if heads_field == "mamba_num_heads":  # Nemotron-H: I = heads * head_dim by construction
        head_dim = _field(layer, "mamba_head_dim")
        inner = heads * head_dim
    else:  # Granite-4.0-H, Bamba, Falcon-H1
        if layer.config.get("mamba_d_ssm") is not None:
            inner = _field(layer, "mamba_d_ssm")
        else:
            inner = _field(layer, "mamba_expand") * _field(layer, "hidden_size")
        head_dim_value = layer.config.get("mamba_d_head")
        head_dim = (
            inner // heads if head_dim_value in (None, "auto") else _field(layer, "mamba_d_head")
        )
        if heads * head_dim != inner:
            raise ConfigError(
                f"layer {layer.name}: mamba_n_heads={heads} x mamba_d_head={head_dim} != the "
                f"Mamba inner size {inner}; fix the model config"
            )
    heads_here = _per_rank(layer, heads_field, heads)
    inner_here = heads_here * head_dim
    groups_here = _groups_per_rank(layer, "n_groups", groups)
    conv = (d_conv - 1, inner_here + 2 * groups_here * d_state)
    return "mamba2", (conv, (heads_here, head_dim, d_state))


def gated_delta_net_state(layer: LayerConfig) -> StateLayout:
    d_conv = _field(layer, "linear_conv_kernel_dim", minimum=MIN_CONV_KERNEL)
    k_dim = _field(layer, "linear_key_head_dim")
    v_dim = _field(layer, "linear_value_head_dim")
    all_k_heads = _field(layer, "linear_num_key_heads")
    all_v_heads = _field(layer, "linear_num_value_heads")
    if all_v_heads % all_k_heads:
        # Each key head serves num_v_heads // num_k_heads value heads: the model code (vLLM's
        # and transformers') views its projections per key head, so no such model exists.
        raise ConfigError(
            f"layer {layer.name}: linear_num_value_heads={all_v_heads} is not a multiple of "
            f"linear_num_key_heads={all_k_heads}; each key head serves a whole number of value "
            "heads. Fix the model config"
        )
    k_heads = _per_rank(layer, "linear_num_key_heads", all_k_heads)
    v_heads = _per_rank(layer, "linear_num_value_heads", all_v_heads)
    conv = (d_conv - 1, 2 * k_heads * k_dim + v_heads * v_dim)
    return "gated_delta_net", (conv, (v_heads, k_dim, v_dim))


def lightning_attention_state(layer: LayerConfig) -> StateLayout:
    heads = _field(layer, "num_attention_heads")
    if layer.config.get("head_dim") is not None:
        head_dim = _field(layer, "head_dim")
    else:
        head_dim = _field(layer, "hidden_size") // heads
    return "linear_attention", (
        (_per_rank(layer, "num_attention_heads", heads), head_dim, head_dim),
    )


def _layout_of(layer: LayerConfig) -> Callable[[LayerConfig], StateLayout]:
    config = layer.config
    if config.get("linear_num_value_heads") is not None:
        return gated_delta_net_state
    if layer.layer_type == "linear_attention" and config.get("attn_type_list") is not None:
        return lightning_attention_state
    if config.get("mamba_num_heads") is not None or config.get("mamba_n_heads") is not None:
        return mamba2_state
    if config.get("mamba_d_state") is not None or config.get("state_size") is not None:
        return mamba1_state
    raise ConfigError(
        f"layer {layer.name} is a {layer.layer_type} layer but its state layout is not "
        "recognised: expected Mamba-1 fields (mamba_d_state, mamba_d_conv, mamba_expand), "
        "Mamba-2 fields (mamba_num_heads or mamba_n_heads, ...) or gated delta-net fields "
        "(linear_num_value_heads, ...); install a plugin for this layer kind"
    )


def mamba_spec(layer: LayerConfig) -> MambaSpec | None:
    """The state spec of ``layer`` if it is a Mamba or linear-attention layer, else ``None``."""
    if layer.layer_type not in STATE_LAYER_TYPES:
        return None
    mamba_type, shapes = _layout_of(layer)(layer)
    for shape in shapes:
        for dimension in shape:
            if dimension > MAX_FIELD_VALUE:
                raise ConfigError(
                    f"layer {layer.name}: the {mamba_type} state dimension {dimension} (state "
                    f"shapes {shapes}) exceeds the limit of {MAX_FIELD_VALUE}; fix the size "
                    "fields it is computed from (mamba_expand, hidden_size, head counts and "
                    "sizes) in the model config"
                )
    if len(shapes) == 1:  # a lone recurrent state, kept in the model dtype
        dtypes: tuple[torch.dtype, ...] = (layer.model_dtype,)
    else:  # (conv window, SSM state)
        dtypes = (layer.model_dtype, ssm_dtype_of(layer))
    fields: dict[str, Any] = dict(
        block_size=layer.options.block_size,
        shapes=shapes,
        dtypes=dtypes,
        mamba_type=mamba_type,
    )
    return MambaSpec(**fields)
