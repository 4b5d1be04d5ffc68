"""Helpers shared by this plugin's tests (named uniquely so the test folders of several
plugins can run in one pytest session)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import kvspec_mamba.plugin as mamba_plugin
from kvspec_core import LayerConfig, PlanOptions, PluginManager
from kvspec_core.testing import manager_with

DATA = Path(__file__).parent / "data"

JAMBA = "ai21labs__AI21-Jamba-1.5-Mini"
NEMOTRON_H_56B = "nvidia__Nemotron-H-56B-Base-8K"
QWEN3_NEXT = "Qwen__Qwen3-Next-80B-A3B-Thinking"


def load_config(name: str) -> dict[str, Any]:
    """A real Hugging Face ``config.json`` copied under ``tests/data`` (Nemotron-H's holds a
    bare ``Infinity``, which Python's json accepts)."""
    return json.loads((DATA / f"{name}.json").read_text())


def nemotron_h_8b_config() -> dict[str, Any]:
    """Nemotron-H-8B's Mamba-2 geometry on the 56B config: the two share ``mamba_head_dim``
    64, ``n_groups`` 8 and ``conv_kernel`` 4; the 8B has 128 heads, ``ssm_state_size`` 128
    and ``hidden_size`` 4096."""
    return dict(
        load_config(NEMOTRON_H_56B), mamba_num_heads=128, ssm_state_size=128, hidden_size=4096
    )


def manager_with_plugin() -> PluginManager:
    """A fresh manager holding only the core and this plugin."""
    return manager_with(mamba_plugin, "mamba")


def state_layer(
    config: dict[str, Any],
    layer_type: str = "mamba",
    *,
    index: int = 0,
    block_size: int = 16,
    tp: int = 1,
) -> LayerConfig:
    """A hand-built bf16 state layer (no attention geometry) for configs the core's ingestion
    would not build from: synthetic field layouts, invalid fields, a TP the model's attention
    layers refuse, another layer type. Layers of real configs come from
    :func:`kvspec_core.testing.model_layer`."""
    return LayerConfig(
        index=index,
        name=f"model.layers.{index}",
        layer_type=layer_type,
        config=config,
        options=PlanOptions(block_size=block_size, tensor_parallel_size=tp),
        model_dtype=torch.bfloat16,
    )
