"""The KV budget of one GPU: its memory times the utilisation vLLM may take, less the weights
that GPU holds and vLLM's overheads, per pipeline stage.

``--gpu NAME`` (or ``--gpu-memory SIZE``) x ``--gpu-memory-utilization`` (0.9 by default, as
vLLM's) is what one worker may use; the weights come from the checkpoint (the
safetensors index's ``total_size`` or a single file's header) split over the ranks in the
proportions of the model's own tensors, or, without a checkpoint, from the parameters
transformers builds on the meta device, as stored (see :mod:`stored_bytes`); the overheads
from :mod:`overheads` or ``--overhead``. What is left is the KV budget the planner fills.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

import attrs

from kvspec_core.deployment.checkpoint import CheckpointSize
from kvspec_core.deployment.overheads import Overheads, estimate_overheads, overridden_overheads
from kvspec_core.deployment.parameters import ModelWeights, model_weights
from kvspec_core.deployment.quant_split import positive_field, quantized_split_refusal
from kvspec_core.deployment.sharding import stage_weight_bytes
from kvspec_core.deployment.stored_bytes import (
    QUANT_METHODS,
    check_quantization,
    quantization,
    stored_bytes,
)
from kvspec_core.errors import CapacityError, ConfigError
from kvspec_core.models.attention_shape import declared_kv_heads
from kvspec_core.models.pipeline import stage_ranges

#: vLLM's default --gpu-memory-utilization.
DEFAULT_UTILIZATION = 0.9
#: TP sizes tried when looking for the smallest that fits.
_TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)


@attrs.frozen(kw_only=True)
class WeightsSource:
    """Where the weights' size comes from.

    Attributes:
        kind: ``safetensors index``, ``safetensors header`` or ``parameter count``.
        checkpoint_bytes: the whole model's stored bytes (unsharded, unpadded).
        parameters: the parameter count transformers builds (``None`` when it cannot).
        quant_method: the config's ``quantization_config.quant_method``, if any.
        path: the metadata file read, or ``None``.
        model: the model's tensors (``None`` when transformers cannot build it).
        stored: each tensor's stored bytes, by name.
        unsplittable: why the weights cannot be split over TP / PP ranks (``None`` when
            they can).
        assumed: what the count had to assume that the config does not say (``None`` when
            nothing): a multimodal config without its ``vision_config`` is counted with
            transformers' default vision tower, not necessarily the checkpoint's.
    """

    kind: str
    checkpoint_bytes: int
    parameters: int | None
    quant_method: str | None
    path: str | None
    model: ModelWeights | None = attrs.field(repr=False)
    stored: Mapping[str, Fraction] = attrs.field(repr=False)
    unsplittable: str | None = None
    assumed: str | None = None


@attrs.frozen(kw_only=True)
class GpuBudget:
    """One GPU's memory, per pipeline stage.

    Attributes:
        memory_bytes: the GPU's total memory.
        utilization: the share vLLM may take.
        usable_bytes: ``floor(memory_bytes x utilization)``.
        weights_bytes: per stage, the weights one GPU of it holds.
        overheads: activation and non-torch memory per GPU.
        kv_budget_bytes: per stage, what is left for the KV cache (may be negative).
    """

    memory_bytes: int
    utilization: float
    usable_bytes: int
    weights_bytes: tuple[int, ...]
    overheads: Overheads
    tp: int

    @property
    def kv_budget_bytes(self) -> tuple[int, ...]:
        return tuple(
            self.usable_bytes - weights - self.overheads.total_bytes
            for weights in self.weights_bytes
        )

    @property
    def fits(self) -> bool:
        return all(budget > 0 for budget in self.kv_budget_bytes)


def weights_source(
    raw: Mapping[str, Any],
    num_layers: int,
    model_dtype_bytes: int,
    checkpoint: CheckpointSize | None,
    *,
    downcast: str | None = None,
) -> WeightsSource:
    """The weights of the model ``raw`` describes: the checkpoint's stored size when there is
    one, and the model's tensors (to split them) when transformers can build it.

    ``downcast``: why the engine loads the weights in a narrower dtype than the checkpoint's
    (``model_dtype_bytes`` is then the loaded dtype's): the checkpoint's stored size is no
    longer what a GPU holds, so the parameters are counted in the loaded dtype instead."""
    quant = quantization(raw)
    method = quant.get("quant_method") if quant else None
    unsplittable = None
    try:
        model = model_weights(raw, num_layers)
    except ConfigError as error:
        if checkpoint is None:
            raise
        model, unsplittable = None, str(error)
    if downcast is not None and checkpoint is not None:
        if model is None or (quant is not None and method not in QUANT_METHODS):
            raise ConfigError(
                f"{downcast}, so the checkpoint's stored size ({checkpoint.path}) is not what "
                "a GPU holds, and kvspec cannot count the parameters in the loaded dtype "
                f"({unsplittable or f'quant_method {method!r} is not modelled per tensor'}); "
                "run vLLM and pass the KV cache size it reports as --memory"
            )
        checkpoint = None  # every tensor is allocated in the loaded dtype: count parameters
    stored: dict[str, Fraction] = {}
    if model is not None and (checkpoint is None or quant is None or method in QUANT_METHODS):
        check_quantization(quant)  # its fields size every quantised tensor, index or not
        stored = {t.name: stored_bytes(t, model_dtype_bytes, quant) for t in model.tensors}
    elif model is not None:
        unsplittable = (
            f"quantization_config.quant_method {method!r}: kvspec does not model its stored "
            "layout per tensor, so the checkpoint's total cannot be divided among the ranks"
        )
    if checkpoint is not None:
        total, kind, path = checkpoint.total_bytes, checkpoint.kind, str(checkpoint.path)
    else:
        total, kind, path = math.ceil(sum(stored.values())), "parameter count", None
    return WeightsSource(
        kind=kind,
        checkpoint_bytes=total,
        parameters=None if model is None else model.parameters,
        quant_method=method if isinstance(method, str) else None,
        path=path,
        model=model,
        stored=stored,
        unsplittable=unsplittable,
        assumed=_default_vision_tower(raw) if checkpoint is None else None,
    )


def _default_vision_tower(raw: Mapping[str, Any]) -> str | None:
    """Why a parameter count of ``raw`` holds a vision tower the config does not describe:
    a multimodal config (a ``text_config`` under a ``...ForConditionalGeneration``) without
    its ``vision_config`` gets transformers' default one (Llama-4-Scout's preset, trimmed:
    a 455M-parameter tower where the checkpoint's has 872M)."""
    architectures = raw.get("architectures")
    multimodal = (
        isinstance(raw.get("text_config"), Mapping)
        and isinstance(architectures, list)
        and any(
            isinstance(name, str) and name.endswith("ForConditionalGeneration")
            for name in architectures
        )
    )
    if not multimodal or "vision_config" in raw:
        return None
    return (
        "the config has no vision_config, so transformers' default vision tower is counted, "
        "which may differ from the checkpoint's; put its model.safetensors.index.json beside "
        "its config.json for the exact size"
    )


def per_stage_weights(
    source: WeightsSource, tp: int, ranges: Sequence[tuple[int, int]]
) -> tuple[int, ...]:
    """Bytes of weights one GPU of each stage holds at ``tp``: the split of the model's
    tensors, scaled to the checkpoint's stored size when one was read."""
    if source.model is None or not source.stored:
        if tp == 1 and len(ranges) == 1:
            return (source.checkpoint_bytes,)
        raise ConfigError(
            f"the weights cannot be split over TP {tp} x PP {len(ranges)}: "
            f"{source.unsplittable}; plan with --tp 1 --pp 1, or run vLLM at this TP / PP "
            "and pass the KV cache size it reports as --memory"
        )
    shares = stage_weight_bytes(source.model, source.stored, tp, ranges)
    scale = Fraction(source.checkpoint_bytes) / sum(source.stored.values())
    return tuple(math.ceil(share * scale) for share in shares)


def gpu_budget(
    source: WeightsSource,
    raw: Mapping[str, Any],
    *,
    memory_bytes: int,
    utilization: float,
    tp: int,
    pp: int,
    partition: Sequence[int] | None,
    overhead_bytes: int | None,
) -> GpuBudget:
    """One GPU's budget per stage at ``tp`` x ``pp``."""
    num_layers = source.model.num_layers if source.model is not None else None
    ranges = stage_ranges(num_layers, pp, partition) if num_layers is not None else [(0, 1)] * pp
    overheads = (
        estimate_overheads(raw, tp, pp)
        if overhead_bytes is None
        else overridden_overheads(overhead_bytes)
    )
    return GpuBudget(
        memory_bytes=memory_bytes,
        utilization=utilization,
        usable_bytes=math.floor(memory_bytes * utilization),
        weights_bytes=per_stage_weights(source, tp, ranges),
        overheads=overheads,
        tp=tp,
    )


def tp_refusal(raw: Mapping[str, Any], tp: int) -> str | None:
    """Why vLLM refuses ``tp`` for the model, or ``None`` when it accepts it: TP must divide
    the attention heads (an encoder-decoder's encoder and decoder heads), divide or be a
    multiple of the KV heads (``QKVParallelLinear``), for a Mamba-2 mixer divide its
    heads and its groups unless there is one group (``MambaMixer2``'s asserts), and leave
    each rank whole quantisation blocks or groups (:mod:`quant_split`)."""
    text = raw.get("text_config")
    fields = text if isinstance(text, Mapping) else raw
    for name in (
        "num_attention_heads",
        "n_head",
        "n_heads",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "mamba_num_heads",
    ):
        count = positive_field(fields, name)
        if count is not None and count % tp:
            return f"TP {tp} does not divide {name} {count}"
    declared = declared_kv_heads(fields)
    if declared is not None and declared[1] % tp and tp % declared[1]:
        field, kv_heads = declared
        return f"TP {tp} neither divides nor is a multiple of {field} {kv_heads}"
    groups = positive_field(fields, "n_groups")
    if positive_field(fields, "mamba_num_heads") and groups not in (None, 1) and groups % tp:
        return f"TP {tp} does not divide the Mamba-2 mixer's n_groups {groups}"
    return quantized_split_refusal(raw, tp)


def tp_candidates(raw: Mapping[str, Any]) -> list[int]:
    """The TP sizes up to 64 (powers of two) vLLM accepts for the model (:func:`tp_refusal`)."""
    return [tp for tp in _TP_CANDIDATES if tp_refusal(raw, tp) is None]


def weights_do_not_fit(
    budget: GpuBudget,
    smallest: int | None,
    pp: int,
    unsplittable: str | None = None,
    candidates: Sequence[int] = _TP_CANDIDATES,
) -> CapacityError:
    """The error when the weights and overheads leave no KV budget on some stage;
    ``smallest``: the smallest TP at which the weights and one max-length request fit;
    ``unsplittable``: why no larger TP could be tried; ``candidates``: the TPs tried."""
    from kvspec_core.byte_sizes import format_size

    stage = min(range(len(budget.kv_budget_bytes)), key=budget.kv_budget_bytes.__getitem__)
    where = f" on pipeline stage {stage}" if pp > 1 else ""
    if budget.overheads.total_bytes >= budget.usable_bytes:
        fix = (
            "the overheads alone take all of it, which no TP or pipeline stage changes: "
            "check --overhead, or take a larger GPU"
        )
    elif smallest is not None:
        fix = (
            f"the smallest TP that holds them and one request of max_model_len tokens is "
            f"{smallest}: pass --tp {smallest}"
        )
    elif unsplittable is not None:
        fix = (
            f"a larger TP cannot be tried ({unsplittable}): take a larger GPU, or run vLLM "
            "at a larger TP and pass the KV cache size it reports as --memory"
        )
    else:
        tried = f"up to {max(candidates)} " if candidates else ""
        fix = (
            f"no TP {tried}that vLLM accepts for this model holds them and one request of "
            "max_model_len tokens: add pipeline stages (--pp), lower --max-model-len, or "
            "take a larger GPU"
        )
    return CapacityError(
        f"the weights do not fit{where} at TP {budget.tp}: one GPU holds "
        f"{format_size(budget.weights_bytes[stage])} of weights plus "
        f"{format_size(budget.overheads.total_bytes)} of overheads, but may use "
        f"{format_size(budget.usable_bytes)} ({budget.utilization:g} of "
        f"{format_size(budget.memory_bytes)}); {fix}"
    )
