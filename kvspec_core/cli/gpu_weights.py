"""The weights ``kvspec plan --gpu`` counts on each GPU: read from the model's checkpoint
metadata (a local folder or the hub cache), else from its parameters, in the dtype vLLM
loads them in."""

from __future__ import annotations

import attrs
import torch

from kvspec_core.deployment.checkpoint import CheckpointSize, folder_checkpoint, hub_checkpoint
from kvspec_core.deployment.gpu_budget import WeightsSource, weights_source
from kvspec_core.models.catalog import ResolvedModel
from kvspec_core.models.fields import model_dtype
from kvspec_core.models.hub import hub_cache_dir, parse_hub_id
from kvspec_core.models.layer_typing import num_layers
from kvspec_core.models.normalized import ModelConfig


def _checkpoint(resolved: ResolvedModel) -> CheckpointSize | None:
    if resolved.path is None:
        return None  # a preset: configs only; its weights are counted from parameters
    if resolved.source == "hub cache":
        hub_id = parse_hub_id(resolved.name)
        if hub_id is not None:
            return hub_checkpoint(hub_id[0], hub_id[1], hub_cache_dir())
    folder = resolved.path if resolved.path.is_dir() else resolved.path.parent
    return folder_checkpoint(folder)


def as_vllm_loads(config: ModelConfig) -> ModelConfig:
    """``config`` with the dtype vLLM runs it in: ``--dtype auto`` downcasts a float32 model
    to the platform's first supported dtype (``_resolve_auto_dtype`` in vLLM's
    ``config/model.py``), bfloat16 on every GPU of the catalog (compute capability 8.0 or
    more); the weights are then held, and the ``auto`` KV cache stored, in bfloat16."""
    if config.dtype != torch.float32:
        return config
    return attrs.evolve(config, dtype=torch.bfloat16)


def vllm_downcast(config: ModelConfig) -> str | None:
    """Why vLLM holds the weights in a narrower dtype than the config's (the ``loaded_as``
    of the ``--json`` document), ``None`` when it does not."""
    if model_dtype(config.fields) != torch.float32:
        return None
    return "vLLM loads this float32 model in bfloat16 (--dtype auto downcasts float32)"


def model_weights_source(resolved: ResolvedModel, config: ModelConfig) -> WeightsSource:
    """Where the model's weights are counted from (its checkpoint metadata, else its
    parameters), in the dtype vLLM loads them in (``config``: as :func:`as_vllm_loads`
    gives it)."""
    return weights_source(
        resolved.config,
        num_layers(config.fields),
        config.dtype.itemsize,
        _checkpoint(resolved),
        downcast=vllm_downcast(config),
    )
