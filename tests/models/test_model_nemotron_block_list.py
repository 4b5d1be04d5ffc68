"""Nemotron-H's list form ``layers_block_type`` (vLLM, transformers 5) plans as the pattern
form ``hybrid_override_pattern`` does; both forms disagreeing, or an unknown entry, is refused.

Before the list form was read, a Nemotron-H config giving only ``layers_block_type`` planned
all 118 layers as full attention: 10.84 requests at 40 GiB instead of 19.00."""

from __future__ import annotations

from typing import Any

import pytest
from model_testkit import preset, type_string

from kvspec_core.errors import ConfigError
from kvspec_core.models.planning import plan_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

BUDGET = 40 << 30
#: vLLM's names for the pattern characters, and transformers 5's.
VLLM_NAMES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
TRANSFORMERS_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def list_form(names: dict[str, str], **changes: Any) -> dict[str, Any]:
    """The bundled Nemotron-H config with its pattern string turned into the list form."""
    config = preset("nemotron-h-56b")
    pattern = config.pop("hybrid_override_pattern")
    config["layers_block_type"] = [names[char] for char in pattern]
    config.update(changes)
    return config


def concurrency(config: dict[str, Any], manager: PluginManager) -> float:
    result = plan_model(config, BUDGET, PlanOptions(), manager, name="nemotron-h")
    return result.plan.max_concurrency


@pytest.mark.parametrize("names", [VLLM_NAMES, TRANSFORMERS_NAMES], ids=["vllm", "transformers5"])
def test_list_form_plans_as_the_pattern_form(
    names: dict[str, str], kvspec_loaded_manager: PluginManager
) -> None:
    pattern_form = preset("nemotron-h-56b")
    assert type_string(list_form(names)) == type_string(pattern_form)
    assert concurrency(list_form(names), kvspec_loaded_manager) == pytest.approx(19.00, abs=0.005)
    assert concurrency(list_form(names), kvspec_loaded_manager) == concurrency(
        pattern_form, kvspec_loaded_manager
    )


@pytest.mark.usefixtures("without_transformers")
def test_list_form_plans_as_the_pattern_form_without_transformers(
    kvspec_loaded_manager: PluginManager,
) -> None:
    assert concurrency(list_form(VLLM_NAMES), kvspec_loaded_manager) == concurrency(
        preset("nemotron-h-56b"), kvspec_loaded_manager
    )


def test_list_form_alone_gives_the_layer_count() -> None:
    config = list_form(VLLM_NAMES)
    del config["num_hidden_layers"]
    assert type_string(config) == type_string(preset("nemotron-h-56b"))


def test_both_forms_agreeing_plan_as_either() -> None:
    config = list_form(
        VLLM_NAMES, hybrid_override_pattern=preset("nemotron-h-56b")["hybrid_override_pattern"]
    )
    assert type_string(config) == type_string(preset("nemotron-h-56b"))


@pytest.mark.parametrize("transformers", [True, False], ids=["with", "without"])
def test_both_forms_disagreeing_are_refused_naming_the_layer(
    transformers: bool, request: pytest.FixtureRequest
) -> None:
    if not transformers:
        request.getfixturevalue("without_transformers")
    pattern = preset("nemotron-h-56b")["hybrid_override_pattern"]
    config = list_form(VLLM_NAMES, hybrid_override_pattern=pattern)
    config["layers_block_type"][7] = "mamba"  # the pattern has '*' there
    with pytest.raises(
        ConfigError,
        match=(
            r"'hybrid_override_pattern' and 'layers_block_type' disagree at layer 7: the pattern "
            r"has '\*' \(attention\), the list 'mamba' \(mamba\); keep one"
        ),
    ):
        type_string(config)


@pytest.mark.parametrize("transformers", [True, False], ids=["with", "without"])
def test_an_unknown_entry_is_refused_naming_it(
    transformers: bool, request: pytest.FixtureRequest
) -> None:
    if not transformers:
        request.getfixturevalue("without_transformers")
    config = list_form(VLLM_NAMES)
    config["layers_block_type"][3] = "hybrid"
    with pytest.raises(ConfigError, match=r"'layers_block_type'\[3\] is 'hybrid'.*known entries"):
        type_string(config)
