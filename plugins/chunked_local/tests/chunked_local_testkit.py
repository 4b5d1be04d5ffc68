"""Helpers shared by this plugin's tests (named uniquely so the test folders of several
plugins can run in one pytest session)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import kvspec_chunked_local.plugin as chunked_local_plugin
from kvspec_core import PluginManager
from kvspec_core.testing import manager_with

DATA = Path(__file__).parent / "data"


def llama4_config() -> dict[str, Any]:
    """Llama-4-Scout's whole ``config.json`` (layers nested in ``text_config``), as the core's
    ingestion (:func:`kvspec_core.testing.model_layer`) reads it."""
    return json.loads((DATA / "meta-llama__Llama-4-Scout-17B-16E-Instruct.json").read_text())


def manager_with_plugin() -> PluginManager:
    """A fresh manager holding only the core and this plugin."""
    return manager_with(chunked_local_plugin, "chunked_local")


def chunked_fields(**overrides: Any) -> dict[str, Any]:
    """Fields of a Llama-4-Scout chunked layer (8 KV heads of 128, bf16, chunk 8192)."""
    fields: dict[str, Any] = dict(
        block_size=16,
        num_kv_heads=8,
        head_size=128,
        dtype=torch.bfloat16,
        attention_chunk_size=8192,
    )
    fields.update(overrides)
    return fields
