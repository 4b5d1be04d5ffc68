"""What ``kvspec plan MODEL --gpu NAME`` adds to the ``--json`` document (the human breakdown
is rendered from it, :mod:`kvspec_core.cli.gpu_text`).

The plan's keys stay; ``kv_budget_bytes`` is then the bottleneck stage's budget. Added:

* ``gpu``: ``name`` (catalog name, or ``custom`` with ``--gpu-memory`` alone),
  ``description``, ``memory_bytes``, ``memory_source``, ``utilization``, ``usable_bytes``
  (``floor(memory_bytes x utilization)``);
* ``weights``: ``source`` (``safetensors index``, ``safetensors header`` or ``parameter
  count``), ``checkpoint_bytes`` (the whole model as stored; as loaded when ``loaded_as``
  is set), ``parameters`` (transformers' count, or null), ``quant_method`` (or null),
  ``path`` (the metadata file read, or null), ``assumed`` (null, or what the count had
  to assume that the config does not say: a multimodal config without its
  ``vision_config`` is counted with transformers' default vision tower),
  ``loaded_as`` (null, or why vLLM holds the weights in a narrower dtype than the config's:
  a float32 model is loaded, and its ``auto`` KV cache stored, in bfloat16, so its weights
  are its parameters at 2 bytes, not the checkpoint's float32 size);
* ``overheads``: ``activation_bytes``, ``non_torch_bytes`` (per GPU), ``basis``, ``source``;
* ``memory_per_gpu``: per pipeline stage, ``stage``, ``weights_bytes``, ``activation_bytes``,
  ``non_torch_bytes``, ``kv_budget_bytes``, ``kv_bytes_allocated``, ``free_bytes`` (usable
  bytes the plan leaves: padding below one block) and ``reserved_bytes`` (the share
  ``--gpu-memory-utilization`` keeps back);
* ``max_tokens``: ``max_concurrency x max_model_len``, the tokens the tightest stage holds
  for requests of that length.
"""

from __future__ import annotations

import math
from typing import Any

from kvspec_core.deployment.gpu_budget import GpuBudget, WeightsSource
from kvspec_core.models.pipeline import PipelinePlan


def gpu_report(
    pipeline: PipelinePlan,
    budget: GpuBudget,
    gpu: dict[str, Any],
    source: WeightsSource,
    loaded_as: str | None,
) -> dict[str, Any]:
    """The keys above for ``pipeline``, planned within ``budget`` on ``gpu`` (the GPU's
    object as :func:`~kvspec_core.cli.gpu_options.gpu_memory` gives it), the weights
    counted from ``source`` (``loaded_as``: why in a narrower dtype, or ``None``)."""
    allocated = {stage.stage: stage.result.plan.bytes_allocated for stage in pipeline.stages}
    overheads = budget.overheads
    result = pipeline.bottleneck.result
    return {
        "kv_budget_bytes": budget.kv_budget_bytes[pipeline.bottleneck.stage],
        "gpu": {**gpu, "utilization": budget.utilization, "usable_bytes": budget.usable_bytes},
        "weights": {
            "source": source.kind,
            "loaded_as": loaded_as,
            "checkpoint_bytes": source.checkpoint_bytes,
            "parameters": source.parameters,
            "quant_method": source.quant_method,
            "path": source.path,
            "assumed": source.assumed,
        },
        "overheads": {
            "activation_bytes": overheads.activation_bytes,
            "non_torch_bytes": overheads.non_torch_bytes,
            "basis": overheads.basis,
            "source": overheads.source,
        },
        "memory_per_gpu": [
            {
                "stage": stage,
                "weights_bytes": weights,
                "activation_bytes": overheads.activation_bytes,
                "non_torch_bytes": overheads.non_torch_bytes,
                "kv_budget_bytes": kv_budget,
                "kv_bytes_allocated": allocated.get(stage, 0),
                "free_bytes": kv_budget - allocated.get(stage, 0),
                "reserved_bytes": budget.memory_bytes - budget.usable_bytes,
            }
            for stage, (weights, kv_budget) in enumerate(
                zip(budget.weights_bytes, budget.kv_budget_bytes, strict=True)
            )
        ],
        "max_tokens": math.floor(result.plan.max_concurrency * result.context.max_model_len),
    }
