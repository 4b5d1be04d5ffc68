"""The attention function registered with transformers: keys and values read paged.

``paged_attention_forward`` is registered under :data:`ATTENTION_NAME` in transformers'
``AttentionInterface``. It ignores the K/V tensors the model passes in and reads every key a
query needs from the layer's kvspec view through the request's block table (the layer
adapter's ``read``): positions ``[spec.first_attended_position(first query), step end)``,
masked per query to ``[spec.first_attended_position(q), q]``; attention sinks (``s_aux``,
GPT-OSS) join the softmax's denominator. No mask function is
registered for the name, so transformers builds no mask and the family rules come only
from the spec.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface

from kvspec_core.errors import ConfigError
from kvspec_transformers.cache import KVSpecCache
from kvspec_transformers.layer_adapters import PagedAttentionLayer

#: Name of the attention implementation (``model.set_attn_implementation(ATTENTION_NAME)``).
ATTENTION_NAME = "kvspec_paged"
#: Forward keyword carrying the :class:`KVSpecCache` down to the attention function.
CACHE_KWARG = "kvspec_cache"


def attention_mask_of(layer: PagedAttentionLayer, start: int, end: int) -> torch.Tensor:
    """``[queries, keys]`` booleans: query ``q`` of the step may read key ``k``."""
    step = layer.step
    spec = layer.spec
    firsts = torch.tensor(
        [spec.first_attended_position(int(q)) for q in step.positions], dtype=torch.int64
    )
    keys = torch.arange(start, end, dtype=torch.int64)
    return (keys[None, :] >= firsts[:, None]) & (keys[None, :] <= step.positions[:, None])


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` ``[1, heads, q, d]`` over keys read from the paged cache;
    returns ``[1, q, heads, d_v]`` as transformers' attention functions do."""
    cache = kwargs.get(CACHE_KWARG)
    if not isinstance(cache, KVSpecCache):
        raise ConfigError(
            f"the {ATTENTION_NAME!r} attention reads K/V from a KVSpecCache; run the model "
            "through TransformersEngine (it passes the cache as kvspec_cache=...)"
        )
    # getattr, not attribute access: torch types module attributes as Tensor | Module.
    layer = cache.layers[int(getattr(module, "layer_idx"))]  # noqa: B009
    if not isinstance(layer, PagedAttentionLayer):
        raise ConfigError(
            f"layer {module.layer_idx} computes attention but its cache layer is a "
            f"{type(layer).__name__}; register an attention adapter for its spec"
        )
    step = layer.step
    start = layer.spec.first_attended_position(step.start)
    keys, values = layer.read(module, start, step.end)
    allowed = attention_mask_of(layer, start, step.end)
    groups = query.shape[1] // keys.shape[1]
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    keys = keys.to(query.dtype)
    values = values.to(query.dtype)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    if softcap is None and sinks is None:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=allowed, scale=scaling
        )
    else:
        # Logit softcapping (Gemma 2) and attention sinks (GPT-OSS) have no fused kernel:
        # the eager formulas of transformers.
        scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if sinks is None:
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        else:
            weights = _softmax_with_sinks(scores, sinks)
        output = torch.matmul(weights, values)
    return output.transpose(1, 2).contiguous(), None


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax of ``scores`` ``[1, heads, q, k]`` with one sink logit per head: the sink
    joins each row's denominator but has no value (its column is dropped), so a head can
    attend to "nothing". GPT-OSS's ``eager_attention_forward``, step for step."""
    heads = scores.shape[1]
    if sinks.numel() != heads:
        raise ConfigError(
            f"the attention passed s_aux (sinks) of {sinks.numel()} values for {heads} query "
            "heads; one sink logit per head is expected"
        )
    column = sinks.reshape(1, heads, 1, 1).to(scores.dtype).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores, column], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]


def register_paged_attention() -> None:
    """Register :func:`paged_attention_forward` under :data:`ATTENTION_NAME` (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
