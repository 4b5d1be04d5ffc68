"""Bytes a weight tensor takes as its checkpoint stores it, when the weights are counted
from the model's parameters (no safetensors metadata at hand).

Unquantised tensors take the model's dtype. A quantised checkpoint (``quantization_config``
in its config) stores its quantised tensors packed, with scales, as each method's format
does:

* ``mxfp4`` (gpt-oss): the fused expert weights as 4-bit blocks of 32 values (16 bytes) plus
  one scale byte per block, 17/32 bytes per value; every other tensor (attention, router,
  embeddings, LM head, expert biases) in the model's dtype, as the checkpoint keeps them.
* ``fp8``: 1 byte per value of each linear weight in the decoder layers, plus a float32
  ``weight_scale_inv`` per ``weight_block_size`` block (per tensor without blocks, and an
  ``input_scale`` per tensor for ``activation_scheme: static``).
* ``awq`` / ``gptq``: ``bits``-bit values packed in int32 (``qweight``), per group of
  ``group_size`` inputs a packed zero point (``qzeros``) and a float16 scale, and GPTQ's
  int32 ``g_idx`` per input.

Embeddings, the LM head, norms and routers are never quantised, nor modules the config
lists in ``modules_to_not_convert`` (fp8: ``ignored_layers``). Other methods
(compressed-tensors, bitsandbytes, ...) are refused, naming the method: their layout varies
per checkpoint, and the checkpoint's own safetensors index is the exact answer.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from kvspec_core.deployment.parameters import (
    EXPERTS,
    KV_PROJECTION,
    REPLICATED_LINEAR,
    SHARDED,
    WeightTensor,
)
from kvspec_core.errors import ConfigError

QUANT_METHODS = ("mxfp4", "fp8", "awq", "gptq")
#: Roles of the tensors a quantised checkpoint packs: every linear of the decoder layers (K and
#: V projections and MLA's replicated down-projections included), not routers or norms.
_QUANTISED_ROLES = frozenset({SHARDED, EXPERTS, KV_PROJECTION, REPLICATED_LINEAR})


def quantization(raw: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The config's ``quantization_config`` (``text_config``'s when nested), else ``None``."""
    for source in (raw, raw.get("text_config")):
        if isinstance(source, Mapping) and isinstance(source.get("quantization_config"), Mapping):
            found: Mapping[str, Any] = source["quantization_config"]
            return found
    return None


def check_quantization(quant: Mapping[str, Any] | None) -> None:
    """Refuse a quantisation method whose stored layout this module does not model."""
    if quant is None:
        return
    method = quant.get("quant_method")
    if method not in QUANT_METHODS:
        raise ConfigError(
            f"quantization_config.quant_method {method!r}: kvspec counts weights as stored "
            f"from parameters only for {', '.join(QUANT_METHODS)}; put the checkpoint's "
            "model.safetensors.index.json beside its config.json (its metadata.total_size "
            "is exact for any method)"
        )
    if method == "fp8":
        block = quant.get("weight_block_size")
        if block is not None and not (
            isinstance(block, list)
            and len(block) == 2
            and all(type(size) is int and size > 0 for size in block)
        ):
            raise ConfigError(
                "quantization_config.weight_block_size must be two positive integers "
                f"[rows, columns] for fp8, or absent / null for per-tensor scales (found {block!r})"
            )
    if method in ("awq", "gptq"):
        bits, group = quant.get("bits"), quant.get("group_size")
        if type(bits) is not int or not 1 <= bits <= 8:
            raise ConfigError(
                f"quantization_config.bits must be an integer in [1, 8] for {method} "
                f"(found {bits!r})"
            )
        if type(group) is not int or group == 0 or group < -1:
            raise ConfigError(
                f"quantization_config.group_size must be a positive integer or -1 (one group) "
                f"for {method} (found {group!r})"
            )


def _excluded(name: str, quant: Mapping[str, Any]) -> bool:
    """Whether the config keeps ``name``'s module unquantised. Names match as a glob, the
    whole module name or a dotted suffix; AWQ / GPTQ's ``modules_to_not_convert`` also as a
    substring (vLLM's ``is_layer_skipped(..., match_mode="substring")``, transformers alike:
    ``"self_attn"`` keeps every attention linear whole); fp8 lists them in
    ``ignored_layers`` (Fp8Config reads ``modules_to_not_convert`` only without it)."""
    method = quant.get("quant_method")
    patterns = (quant.get("ignored_layers") if method == "fp8" else None) or quant.get(
        "modules_to_not_convert"
    )
    substring = method in ("awq", "gptq")
    module = name.rpartition(".")[0]
    return any(
        isinstance(pattern, str)
        and (
            fnmatch.fnmatch(module, pattern)
            or module == pattern
            or module.endswith("." + pattern)
            or (substring and pattern in module)
        )
        for pattern in patterns or []
    )


def _matrices(tensor: WeightTensor) -> tuple[int, int, int]:
    """(matrices, rows, columns): a 3-D expert tensor is one matrix per expert."""
    if len(tensor.shape) == 3:
        return tensor.shape[0], tensor.shape[1], tensor.shape[2]
    return 1, tensor.shape[0], tensor.shape[1]


def stored_bytes(
    tensor: WeightTensor, model_dtype_bytes: int, quant: Mapping[str, Any] | None
) -> Fraction:
    """Bytes ``tensor`` takes in the checkpoint (a fraction: mxfp4 packs below a byte)."""
    plain = Fraction(tensor.numel * model_dtype_bytes)
    if quant is None or tensor.role not in _QUANTISED_ROLES or len(tensor.shape) < 2:
        return plain
    if tensor.layer is None or tensor.name.endswith("bias") or _excluded(tensor.name, quant):
        return plain
    method = quant["quant_method"]
    if method == "mxfp4":
        return Fraction(tensor.numel * 17, 32) if tensor.role == EXPERTS else plain
    matrices, rows, columns = _matrices(tensor)
    if method == "fp8":
        block = quant.get("weight_block_size")  # validated by check_quantization
        if block is not None:
            scales = math.ceil(rows / block[0]) * math.ceil(columns / block[1])
        else:
            scales = 1 + (quant.get("activation_scheme") == "static")
        return Fraction(tensor.numel + matrices * scales * 4)
    bits, group = quant["bits"], quant["group_size"]
    # group_size -1 means one group over all inputs (columns are the inputs: out x in).
    groups = 1 if group < 0 else math.ceil(columns / group)
    packed = Fraction(rows * columns * bits, 8)
    zeros = Fraction(groups * rows * bits, 8)
    scales = groups * rows * 2
    g_idx = columns * 4 if method == "gptq" else 0
    return matrices * (packed + zeros + scales + g_idx)
