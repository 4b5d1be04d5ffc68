"""Tensor-parallel sizes a quantised checkpoint cannot be split at, as vLLM refuses them.

A block- or group-quantised weight keeps one scale per block (fp8 ``weight_block_size``
``[block_n, block_k]``) or per group of inputs (AWQ / GPTQ ``group_size``), so each rank's
share must hold whole blocks or groups. vLLM checks this when it builds the layers:

* fp8 blocks (``validate_fp8_block_shape`` / ``validate_fp8_block_shape_moe`` in
  ``model_executor/layers/quantization/utils/fp8_utils.py``): a column-parallel output per
  rank (q, k and v, the MLP's or each expert's gate and up) must be a multiple of
  ``block_n``, a row-parallel input per rank (``o_proj``, ``down_proj``) of ``block_k``;
* AWQ / GPTQ (``GPTQLinearMethod.create_weights``, "The input size is not aligned with the
  quantized weight shape"): a row-parallel input per rank must be a multiple of
  ``group_size`` (``-1``: one group, any split).

Checked here: the attention projections and the dense or expert MLP, read from the config's
usual fields; a config without them is not checked (not refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvspec_core.models.attention_shape import declared_kv_heads

#: Fields naming the per-expert MLP width, in the order configs use them.
_EXPERT_WIDTH_FIELDS = ("moe_intermediate_size",)
#: Fields marking experts whose width is ``intermediate_size`` itself (Mixtral).
_LOCAL_EXPERT_FIELDS = ("num_local_experts",)


def positive_field(fields: Mapping[str, Any], name: str) -> int | None:
    """The config field ``name`` when it is a positive int, else None (absent or ill-typed:
    the plan's own checks name it)."""
    value = fields.get(name)
    return value if type(value) is int and value > 0 else None


def _shares(
    fields: Mapping[str, Any], tp: int
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """``(column outputs, row inputs)`` per rank at ``tp``, each named by what it is."""
    columns: list[tuple[str, int]] = []
    rows: list[tuple[str, int]] = []
    heads = positive_field(fields, "num_attention_heads")
    hidden = positive_field(fields, "hidden_size")
    head_dim = positive_field(fields, "head_dim") or (
        hidden // heads if heads and hidden and hidden % heads == 0 else None
    )
    if heads and head_dim and heads % tp == 0:
        width = heads // tp * head_dim
        columns.append(("q_proj's output (num_attention_heads x head_dim / TP)", width))
        rows.append(("o_proj's input (num_attention_heads x head_dim / TP)", width))
        declared = declared_kv_heads(fields)
        kv_heads = heads if declared is None else declared[1]
        kv_width = max(1, kv_heads // tp) * head_dim
        columns.append(("k_proj's and v_proj's output (KV heads per rank x head_dim)", kv_width))
    dense: int | None = positive_field(fields, "intermediate_size")
    expert: int | None = next(
        (value for name in _EXPERT_WIDTH_FIELDS if (value := positive_field(fields, name))), None
    )
    if expert is None and any(name in fields for name in _LOCAL_EXPERT_FIELDS):
        expert, dense = dense, None
    for label, mlp_width in (("intermediate_size", dense), ("moe_intermediate_size", expert)):
        if mlp_width is not None and mlp_width % tp == 0:
            share = mlp_width // tp
            columns.append((f"gate_proj's and up_proj's output ({label} / TP)", share))
            rows.append((f"down_proj's input ({label} / TP)", share))
    return columns, rows


def quantized_split_refusal(raw: Mapping[str, Any], tp: int) -> str | None:
    """Why vLLM refuses to split the config ``raw``'s quantised weights over ``tp`` ranks,
    or ``None`` (not quantised by blocks or groups, or every share holds whole ones)."""
    quant = raw.get("quantization_config")
    if tp <= 1 or not isinstance(quant, Mapping):
        return None
    text = raw.get("text_config")
    fields = text if isinstance(text, Mapping) else raw
    columns, rows = _shares(fields, tp)
    method = quant.get("quant_method")
    block = quant.get("weight_block_size")
    if method == "fp8" and isinstance(block, list) and len(block) == 2:
        block_n, block_k = block
        if type(block_n) is int and type(block_k) is int and block_n > 0 and block_k > 0:
            for what, size in columns:
                if size % block_n:
                    return (
                        f"at TP {tp} {what} is {size:,}, not a multiple of the fp8 "
                        f"weight_block_size's block_n {block_n}"
                    )
            for what, size in rows:
                if size % block_k:
                    return (
                        f"at TP {tp} {what} is {size:,}, not a multiple of the fp8 "
                        f"weight_block_size's block_k {block_k}"
                    )
    group, bits = quant.get("group_size"), quant.get("bits")
    # A malformed config (no bits) is left to the weights' checks, which name the field.
    if method in ("awq", "gptq") and type(group) is int and group > 0 and type(bits) is int:
        for what, size in rows:
            if size % group:
                return (
                    f"at TP {tp} {what} is {size:,}, not a multiple of the {method} "
                    f"group_size {group}"
                )
    return None
