"""A ``model_type`` that is not a name and RoPE fields that are not objects of numeric
parameters are refused naming the field (found by review: ``model_type: 5`` planned with
kvspec's own defaults instead of transformers', and ``rope_scaling: "yes"`` or a string
factor left the default length unscaled, both silently)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from model_testkit import preset

from kvspec_core.errors import ConfigError
from kvspec_core.models.planning import plan_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager


def plan(config: dict[str, Any], manager: PluginManager) -> None:
    plan_model(config, 40 << 30, PlanOptions(), manager, name="test")


def linear_rope(factor: object) -> dict[str, Any]:
    """Qwen2.5-7B with a linear RoPE scaling of ``factor``."""
    return {**preset("qwen2.5-7b"), "rope_scaling": {"rope_type": "linear", "factor": factor}}


@pytest.mark.parametrize("model_type", [5, "", ["llama"], True], ids=repr)
def test_a_model_type_that_is_not_a_name_is_refused(
    model_type: object, kvspec_loaded_manager: PluginManager
) -> None:
    with pytest.raises(ConfigError, match=r"config field 'model_type' is .* must be the arch"):
        plan({**preset("llama-3.1-8b"), "model_type": model_type}, kvspec_loaded_manager)


def test_a_nested_model_type_is_named_with_its_path(
    kvspec_loaded_manager: PluginManager,
) -> None:
    config = preset("llama-4-scout")
    config["text_config"] = {**config["text_config"], "model_type": 7}
    with pytest.raises(ConfigError, match=r"'text_config\.model_type' is 7"):
        plan(config, kvspec_loaded_manager)


@pytest.mark.parametrize("rope", ["yes", 2.0, ["linear", 2.0]], ids=repr)
def test_rope_scaling_that_is_not_an_object_is_refused(
    rope: object, kvspec_loaded_manager: PluginManager
) -> None:
    with pytest.raises(ConfigError, match=r"config field 'rope_scaling' is .* object of RoPE"):
        plan({**preset("llama-3.1-8b"), "rope_scaling": rope}, kvspec_loaded_manager)


@pytest.mark.parametrize("factor", ["2", -2.0, 0, math.nan, math.inf, True], ids=repr)
def test_a_rope_factor_that_is_not_a_positive_number_is_refused(
    factor: object, kvspec_loaded_manager: PluginManager
) -> None:
    with pytest.raises(ConfigError, match=r"'rope_scaling\.factor' is .* positive number"):
        plan(linear_rope(factor), kvspec_loaded_manager)
    per_layer = {"full_attention": {"rope_type": "linear", "factor": factor}}
    with pytest.raises(ConfigError, match=r"'rope_parameters\.full_attention\.factor'"):
        plan({**preset("qwen2.5-7b"), "rope_parameters": per_layer}, kvspec_loaded_manager)


def test_valid_rope_fields_still_plan(kvspec_loaded_manager: PluginManager) -> None:
    plan(linear_rope(2), kvspec_loaded_manager)
    plan({**preset("qwen2.5-7b"), "rope_scaling": None}, kvspec_loaded_manager)


@pytest.mark.parametrize("factor", [1e308, 1e10])
def test_a_rope_factor_scaling_the_length_past_the_limit_is_refused(
    factor: float, kvspec_loaded_manager: PluginManager
) -> None:
    # Found by review: 1e308 gave a traceback (int of infinity), 1e10 an error naming
    # SizingContext.max_model_len.
    with pytest.raises(ConfigError, match=r"RoPE scaling factor .* fix the factor"):
        plan(linear_rope(factor), kvspec_loaded_manager)
