"""Model configs to layer specs: config ingestion, planning, presets.

Public API::

    from kvspec_core.models import resolve_model, plan_model, PlanOptions
    model = resolve_model("llama-3.1-8b")    # preset, config.json, folder or hub id (org/name)
    result = plan_model(model.config, 40 << 30, PlanOptions(), manager, name=model.name)
    result.plan.max_concurrency

A config is read once by :func:`normalize_config` into a :class:`ModelConfig` (the language
model's fields, defaults filled by transformers' config class when ``kvspec-core[hf]`` is
installed, the model dtype); every function taking a config accepts either. Pipeline stages:
:mod:`kvspec_core.models.pipeline` (``split_stages``, ``plan_stages``).

Lower level: :func:`model_layers` (config -> typed
:class:`~kvspec_core.plugins.LayerConfig` s, the plugin contract's view of a layer),
:func:`layer_specs` (one spec per layer via the plugins), :func:`default_sizing_context`.
Everything is imported lazily, so importing ``kvspec_core.models`` costs nothing until used.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "PlanOptions": "kvspec_core.plugins.layer_config",
    "ModelLayers": "kvspec_core.models.ingest",
    "model_layers": "kvspec_core.models.ingest",
    "layer_specs": "kvspec_core.models.ingest",
    "default_sizing_context": "kvspec_core.models.ingest",
    "ModelPlan": "kvspec_core.models.planning",
    "PreparedModel": "kvspec_core.models.planning",
    "plan_model": "kvspec_core.models.planning",
    "prepare_model": "kvspec_core.models.planning",
    "concurrency_curve": "kvspec_core.models.planning",
    "ResolvedModel": "kvspec_core.models.catalog",
    "resolve_model": "kvspec_core.models.catalog",
    "preset_names": "kvspec_core.models.catalog",
    "load_preset": "kvspec_core.models.catalog",
    "read_config": "kvspec_core.models.config_file",
    "ModelConfig": "kvspec_core.models.normalized",
    "normalize_config": "kvspec_core.models.normalized",
    "MissingConfigFieldError": "kvspec_core.models.fields",
    "model_families": "kvspec_core.models.families",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvspec_core.models' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = list(_LAZY)
