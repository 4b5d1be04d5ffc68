"""A pattern field kvspec refuses is refused before transformers derives ``layer_types`` from
it, with or without transformers, naming the field and the fix.

Before: with transformers installed, Qwen3-Next's ``full_attention_interval`` = true, 1.5, -1,
1e308 or NaN all planned (NaN / 1e308 as all linear attention, 407 requests at 40 GiB; -1 as
all full attention), because transformers filled ``layer_types`` from the bad value first."""

from __future__ import annotations

import math
from typing import Any

import pytest
from model_testkit import preset

from kvspec_core.errors import ConfigError
from kvspec_core.models.planning import plan_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

BAD_INTERVALS = [True, 1.5, -1, 0, 1e308, math.nan, "4"]
#: (preset, field, a bad value) for the other fields transformers derives a typing from.
OTHER_BAD_FIELDS = [
    ("gemma-2-9b", "sliding_window_pattern", 2.5),
    ("jamba-1.5-mini", "attn_layer_period", math.inf),
    ("jamba-1.5-mini", "attn_layer_offset", -1),
    ("qwen2.5-7b", "max_window_layers", math.nan),
    ("qwen2.5-7b", "use_sliding_window", "false"),
    ("llama-4-scout", "no_rope_layer_interval", 0.5),
]


def plan(config: dict[str, Any], manager: PluginManager) -> None:
    plan_model(config, 40 << 30, PlanOptions(), manager, name="test")


@pytest.fixture(params=["with transformers", "without transformers"])
def transformers_or_not(request: pytest.FixtureRequest) -> None:
    if request.param == "without transformers":
        request.getfixturevalue("without_transformers")


@pytest.mark.usefixtures("transformers_or_not")
@pytest.mark.parametrize("interval", BAD_INTERVALS, ids=repr)
def test_a_bad_full_attention_interval_is_refused_naming_it(
    interval: object, kvspec_loaded_manager: PluginManager
) -> None:
    config = {**preset("qwen3-next-80b"), "full_attention_interval": interval}
    with pytest.raises(
        ConfigError,
        match=(
            r"config field 'full_attention_interval' is .*it must be an int in \[1, .*Fix "
            r"'full_attention_interval' in the model config"
        ),
    ):
        plan(config, kvspec_loaded_manager)


@pytest.mark.usefixtures("transformers_or_not")
@pytest.mark.parametrize("name, field, value", OTHER_BAD_FIELDS, ids=lambda v: str(v))
def test_other_bad_pattern_fields_are_refused_naming_them(
    name: str, field: str, value: object, kvspec_loaded_manager: PluginManager
) -> None:
    config = {**preset(name), field: value}
    if name == "llama-4-scout":  # its language model is nested in text_config
        config["text_config"] = {**config["text_config"], field: value}
    with pytest.raises(ConfigError, match=f"config field '{field}' is .*Fix '{field}'"):
        plan(config, kvspec_loaded_manager)


@pytest.mark.usefixtures("transformers_or_not")
def test_a_valid_interval_still_plans(kvspec_loaded_manager: PluginManager) -> None:
    plan({**preset("qwen3-next-80b"), "full_attention_interval": 4}, kvspec_loaded_manager)
