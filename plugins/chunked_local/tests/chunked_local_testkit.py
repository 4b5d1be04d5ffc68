"""Helpers shared by this plugin's tests (named uniquely so the test folders of several
plugins can run in one pytest session)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvspec_core import AttentionShape, LayerConfig, PlanOptions, PluginManager
from kvspec_core.dtypes import dtype_from_name
from kvspec_core.testing import manager_with

import kvspec_chunked_local.plugin as chunked_local_plugin

DATA = Path(__file__).parent / "data"


def llama4_config() -> dict[str, Any]:
    """Llama-4-Scout's whole ``config.json`` (layers nested in ``text_config``), as the core's
    ingestion (:func:`kvspec_core.testing.model_layer`) reads it."""
    return json.loads((DATA / "meta-llama__Llama-4-Scout-17B-16E-Instruct.json").read_text())


def llama4_text_config() -> dict[str, Any]:
    """The text config of Llama-4-Scout (the core hands plugins the text config)."""
    return dict(llama4_config()["text_config"])


def manager_with_plugin() -> PluginManager:
    """A fresh manager holding only the core and this plugin."""
    return manager_with(chunked_local_plugin, "chunked_local")


def layer_from_config(
    config: dict[str, Any], index: int, layer_type: str, *, block_size: int = 16, tp: int = 1
) -> LayerConfig:
    """A hand-built :class:`LayerConfig` for a deliberately invalid config, which the core's
    ingestion would not type as chunked. It is not exactly what the core builds: the core
    names Llama-4's layers ``model.layers.N``, not ``language_model.model.layers.N``. Layers of
    valid configs come from :func:`kvspec_core.testing.model_layer`."""
    total_kv_heads = config["num_key_value_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    dtype = dtype_from_name(config.get("torch_dtype", "bfloat16"))
    shape = AttentionShape(
        num_kv_heads=max(1, total_kv_heads // tp),
        total_kv_heads=total_kv_heads,
        head_size=head_size,
        head_size_v=head_size,
        dtype=dtype,
        replicated=tp > total_kv_heads,
    )
    return LayerConfig(
        index=index,
        name=f"language_model.model.layers.{index}",
        layer_type=layer_type,
        config=config,
        options=PlanOptions(block_size=block_size, tensor_parallel_size=tp),
        model_dtype=dtype,
        attention=shape,
    )


def chunked_fields(**overrides: Any) -> dict[str, Any]:
    """Fields of a Llama-4-Scout chunked layer (8 KV heads of 128, bf16, chunk 8192)."""
    fields: dict[str, Any] = dict(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16,
        attention_chunk_size=8192,
    )
    fields.update(overrides)
    return fields
