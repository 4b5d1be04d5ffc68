"""Helpers for the model-ingestion tests: presets by name, layers typed without plugins."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvspec_core.models.catalog import load_preset
from kvspec_core.models.ingest import ModelLayers, model_layers
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

#: One letter per normalised layer type, to compare a whole model's typing as a string.
TYPE_LETTERS = {
    "full_attention": "F",
    "sliding_attention": "S",
    "chunked_attention": "C",
    "mla_attention": "L",
    "sliding_mla_attention": "l",
    "linear_attention": "N",
    "mamba": "M",
    "cross_attention": "X",
    "encoder_only": "E",
}


def typed(config: Mapping[str, Any], **options: Any) -> ModelLayers:
    """``config`` typed into layers with a core-only manager (typing needs no plugin)."""
    return model_layers(config, PlanOptions(**options), PluginManager(), name="test")


def type_string(config: Mapping[str, Any]) -> str:
    """The model's layer types as letters (see :data:`TYPE_LETTERS`)."""
    return "".join(TYPE_LETTERS[layer.layer_type] for layer in typed(config).layers)


def preset(name: str) -> dict[str, Any]:
    return load_preset(name)
