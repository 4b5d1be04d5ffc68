"""Helpers shared by this plugin's tests (named uniquely so the test folders of several
plugins can run in one pytest session). Layers of real configs come from the core's own
ingestion: :func:`kvspec_core.testing.model_layer`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import kvspec_sliding_window.plugin as sliding_window_plugin
from kvspec_core import PluginManager
from kvspec_core.testing import manager_with

DATA = Path(__file__).parent / "data"


def load_config(name: str) -> dict[str, Any]:
    """A real Hugging Face ``config.json`` copied under ``tests/data``."""
    return json.loads((DATA / f"{name}.json").read_text())


def manager_with_plugin() -> PluginManager:
    """A fresh manager holding only the core and this plugin."""
    return manager_with(sliding_window_plugin, "sliding_window")


def swa_fields(**overrides: Any) -> dict[str, Any]:
    """Fields of a Mistral-7B-like sliding-window layer (8 KV heads of 128, bf16)."""
    fields: dict[str, Any] = dict(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, sliding_window=4096
    )
    fields.update(overrides)
    return fields
