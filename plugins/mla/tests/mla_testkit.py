"""Helpers shared by kvspec-mla's tests (named uniquely so the test folders of several
plugins can run in one pytest session)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import kvspec_mla.plugin as mla_plugin
from kvspec_core import AttentionShape, LayerConfig, PlanOptions, PluginManager
from kvspec_core.dtypes import dtype_from_name
from kvspec_core.testing import manager_with

DATA = Path(__file__).parent / "data"
DEEPSEEK_V2_LITE = "deepseek-ai__DeepSeek-V2-Lite"


def load_config(name: str = DEEPSEEK_V2_LITE) -> dict[str, Any]:
    """A real Hugging Face ``config.json`` copied under ``tests/data``."""
    return json.loads((DATA / f"{name}.json").read_text())


def manager_with_mla() -> PluginManager:
    """A fresh manager holding only the core and kvspec-mla."""
    return manager_with(mla_plugin, "mla")


def mla_layer(
    config: dict[str, Any],
    index: int = 0,
    *,
    layer_type: str = "mla_attention",
    block_size: int = 16,
    kv_cache_dtype: str = "auto",
    tp: int = 1,
    attention: AttentionShape | None = None,
) -> LayerConfig:
    """A hand-built :class:`LayerConfig` for layer ``index`` of ``config``, for the odd layers
    the core's ingestion never builds: another layer type, an invalid config, or (by default)
    no resolved attention geometry. Layers of valid configs come from
    :func:`kvspec_core.testing.model_layer`."""
    return LayerConfig(
        index=index,
        name=f"model.layers.{index}",
        layer_type=layer_type,
        config=config,
        options=PlanOptions(
            block_size=block_size, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=tp
        ),
        model_dtype=dtype_from_name(config.get("torch_dtype", "bfloat16")),
        attention=attention,
    )


def latent_fields(**overrides: Any) -> dict[str, Any]:
    """Fields of a DeepSeek-V2-Lite MLA layer: one 576-value bf16 latent, block 16."""
    fields: dict[str, Any] = dict(
        block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, max_tp_shards=1
    )
    fields.update(overrides)
    return fields
