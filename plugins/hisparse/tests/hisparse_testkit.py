"""Helpers shared by kvspec-hisparse's tests (named uniquely so the test folders of several
plugins can run in one pytest session). Only the core and this plugin are imported."""

from __future__ import annotations

from typing import Any

import torch

import kvspec_hisparse.plugin as hisparse_plugin
from kvspec_core import FullAttentionSpec, PluginManager
from kvspec_core.testing import manager_with


def manager_with_hisparse() -> PluginManager:
    """A fresh manager holding only the core and kvspec-hisparse."""
    return manager_with(hisparse_plugin, "hisparse")


def latent_like(**overrides: Any) -> FullAttentionSpec:
    """A core spec with an MLA latent's page (one head of 576 bf16 values per token), so the
    tests need no other plugin."""
    fields: dict[str, Any] = dict(
        block_size=64, num_kv_heads=1, head_size=288, head_size_v=288, dtype=torch.bfloat16
    )
    fields.update(overrides)
    return FullAttentionSpec(**fields)
