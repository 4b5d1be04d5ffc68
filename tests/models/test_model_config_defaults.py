"""Configs that rely on transformers' defaults (Gemma-3, Granite-4.0-H), Bamba's attention
layers, the missing-extra error and the model dtype: planned from real hub configs in
``fixtures/`` with figures computed by hand from the sizing formulas."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from model_testkit import preset, type_string

from kvspec_core.arithmetic import cdiv
from kvspec_core.errors import ConfigError
from kvspec_core.models.fields import MissingConfigFieldError
from kvspec_core.models.normalized import (
    DEFAULTS_FROM_KVSPEC,
    DEFAULTS_FROM_TRANSFORMERS,
    normalize_config,
)
from kvspec_core.models.planning import ModelPlan, plan_model, prepare_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

FIXTURES = Path(__file__).parent / "fixtures"
BUDGET = 40 << 30
IN_FLIGHT = 16384
BF16 = 2


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def gemma3() -> dict[str, Any]:
    return fixture("google__gemma-3-4b-it")


def granite() -> dict[str, Any]:
    return fixture("ibm-granite__granite-4.0-h-small")


def bamba() -> dict[str, Any]:
    return fixture("ibm-ai-platform__Bamba-9B")


def plan(config: dict[str, Any], manager: PluginManager, **options: Any) -> ModelPlan:
    return plan_model(config, BUDGET, PlanOptions(**options), manager, name="test")


def mamba2_state_bytes(
    *, heads: int, head_dim: int, d_state: int, groups: int, d_conv: int, itemsize: int = BF16
) -> int:
    """Conv window ``(d_conv - 1, heads * head_dim + 2 * groups * d_state)`` plus SSM state
    ``(heads, head_dim, d_state)``, both in the model dtype (DESIGN.md's Mamba-2 formula)."""
    conv = (d_conv - 1) * (heads * head_dim + 2 * groups * d_state)
    return (conv + heads * head_dim * d_state) * itemsize


# Gemma-3 ------------------------------------------------------------------------------------


def test_gemma3_text_config_takes_its_head_counts_from_transformers() -> None:
    config = normalize_config(gemma3())
    assert config.defaults_from == DEFAULTS_FROM_TRANSFORMERS
    assert config.model_type == "gemma3_text"
    # Gemma3TextConfig's defaults are the 4B model's geometry.
    assert (
        config.fields["num_attention_heads"],
        config.fields["num_key_value_heads"],
        config.fields["head_dim"],
    ) == (8, 4, 256)
    assert {"num_key_value_heads", "head_dim", "max_position_embeddings"} <= set(
        config.filled_fields
    )
    # The file's own values win over the class defaults.
    assert config.fields["hidden_size"] == 2560 and config.fields["sliding_window"] == 1024
    assert config.dtype == torch.bfloat16 and config.dtype_field == "torch_dtype"


def test_gemma3_plans_five_global_layers_in_34_at_hand_computed_figures(
    kvspec_loaded_manager: PluginManager,
) -> None:
    # Every 6th layer is global (sliding_window_pattern 6): 5, 11, 17, 23, 29.
    assert type_string(gemma3()) == ("S" * 5 + "F") * 5 + "S" * 4
    result = plan(gemma3(), kvspec_loaded_manager)
    assert result.context.max_model_len == 131072
    per_layer_page = 16 * 4 * (256 + 256) * BF16  # block 16, 4 KV heads, K+V of 256, bf16
    pages = {group.kind: group.page_size_bytes for group in result.plan.groups}
    assert pages["full_attention"] == 5 * per_layer_page == 327_680
    sliding_blocks = cdiv(min(1024 - 1 + IN_FLIGHT, 131072), 16) + 1
    assert sliding_blocks == 1089
    per_request = 6 * sliding_blocks + 131072 // 16  # 6 sliding groups + the global group
    (pool,) = result.plan.device_pools
    assert pool.blocks_per_request == per_request == 14_726
    assert pool.num_blocks == BUDGET // (5 * per_layer_page) == 131_072
    assert result.plan.max_concurrency == pytest.approx((131_072 - 1) / 14_726)  # 8.90


# Granite-4.0-H -------------------------------------------------------------------------------


def test_granite_4_h_takes_mamba_expand_from_transformers() -> None:
    config = normalize_config(granite())
    assert "mamba_expand" not in granite()
    assert config.fields["mamba_expand"] == 2 and "mamba_expand" in config.filled_fields
    # layer_types as the file spells them ("mamba" / "attention"), not re-derived.
    assert config.fields["layer_types"] == granite()["layer_types"]


def test_granite_4_h_small_plans_at_hand_computed_figures(
    kvspec_loaded_manager: PluginManager,
) -> None:
    attention = (5, 15, 25, 35)
    assert type_string(granite()) == "".join("F" if i in attention else "M" for i in range(40))
    result = plan(granite(), kvspec_loaded_manager)
    state = mamba2_state_bytes(heads=128, head_dim=64, d_state=128, groups=1, d_conv=4)
    assert state == 2_147_840  # conv (3, 8192 + 256) + ssm (128, 64, 128) in bf16
    mamba_groups = [g for g in result.plan.groups if g.kind == "mamba"]
    assert len(mamba_groups) == 9 and {g.page_size_bytes for g in mamba_groups} == {4 * state}
    (full,) = [g for g in result.plan.groups if g.kind == "full_attention"]
    assert full.page_size_bytes == 4 * 16 * 8 * (128 + 128) * BF16 == 262_144
    state_pool, kv_pool = result.plan.device_pools
    # Prefix caching keeps 2 states per request per Mamba group (align mode).
    assert state_pool.blocks_per_request == 2 * 9
    assert kv_pool.blocks_per_request == 131072 // 16
    # 19 requests' states whole (18.65 when the states were split by fraction too).
    assert result.plan.max_concurrency == pytest.approx(18.63, abs=0.005)
    assert result.plan.max_concurrency == min(p.max_concurrency for p in result.plan.device_pools)


# Bamba ---------------------------------------------------------------------------------------


def test_bamba_attention_sits_at_attn_layer_indices_and_the_rest_is_mamba() -> None:
    assert bamba()["attn_layer_indices"] == [9, 18, 27]
    assert type_string(bamba()) == "".join("F" if i in (9, 18, 27) else "M" for i in range(32))


def test_bamba_plans_three_attention_layers_and_29_mamba_states(
    kvspec_loaded_manager: PluginManager,
) -> None:
    result = plan(bamba(), kvspec_loaded_manager)
    kinds = [spec.kind for spec in result.specs.values()]
    assert kinds.count("mamba") == 29 and kinds.count("full_attention") == 3
    state = mamba2_state_bytes(heads=128, head_dim=64, d_state=128, groups=1, d_conv=4)
    state_pool, kv_pool = result.plan.device_pools
    assert kv_pool.block_bytes == 3 * 16 * 8 * 256 * BF16 == 196_608
    assert kv_pool.blocks_per_request == 262144 // 16
    assert state_pool.block_bytes == 3 * state
    # Far above the 1.25 requests the all-attention misreading gave (32 full layers).
    assert result.plan.max_concurrency == pytest.approx(12.81, abs=0.005)


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        ([9, 32], "'attn_layer_indices[1]' is 32"),
        ([9, 9], "lists layer 9 twice"),
        ("9,18", "must be a list"),
        ([True], "'attn_layer_indices[0]' is True"),
    ],
)
def test_bad_attn_layer_indices_are_refused_naming_the_field(indices: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        type_string({**bamba(), "attn_layer_indices": indices})


# Without transformers ------------------------------------------------------------------------


@pytest.mark.usefixtures("without_transformers")
def test_without_transformers_a_complete_config_plans_the_same(
    kvspec_loaded_manager: PluginManager,
) -> None:
    config = normalize_config(bamba())
    assert config.defaults_from == DEFAULTS_FROM_KVSPEC
    assert "not installed" in (config.defaults_note or "")
    assert plan(bamba(), kvspec_loaded_manager).plan.max_concurrency == pytest.approx(
        12.81, abs=0.005
    )


@pytest.mark.usefixtures("without_transformers")
def test_without_transformers_granite_names_mamba_expand_and_the_extra(
    kvspec_loaded_manager: PluginManager,
) -> None:
    with pytest.raises(MissingConfigFieldError) as caught:
        plan(granite(), kvspec_loaded_manager)
    message = str(caught.value)
    assert "'mamba_expand'" in message and "model.layers.0" in message
    assert "pip install 'kvspec-core[hf]'" in message and "'granitemoehybrid'" in message


@pytest.mark.usefixtures("without_transformers")
def test_without_transformers_gemma3_names_the_head_fields_and_the_extra(
    kvspec_loaded_manager: PluginManager,
) -> None:
    with pytest.raises(MissingConfigFieldError) as caught:
        plan(gemma3(), kvspec_loaded_manager)
    message = str(caught.value)
    assert "'num_key_value_heads'" in message and "'gemma3_text'" in message
    assert "pip install 'kvspec-core[hf]'" in message


def test_unknown_model_type_keeps_the_files_fields(kvspec_loaded_manager: PluginManager) -> None:
    config = {**preset("llama-3.1-8b"), "model_type": "kvspec_unpublished"}
    normalized = normalize_config(config)
    assert normalized.defaults_from == DEFAULTS_FROM_KVSPEC
    assert "does not know model_type 'kvspec_unpublished'" in (normalized.defaults_note or "")
    assert plan(config, kvspec_loaded_manager).plan.num_blocks == 20480
    del config["num_hidden_layers"]
    with pytest.raises(MissingConfigFieldError, match="'num_hidden_layers' is missing") as caught:
        plan(config, kvspec_loaded_manager)
    assert "could not take its default from transformers" in str(caught.value)


def test_a_config_transformers_refuses_keeps_kvspecs_own_checks() -> None:
    # 100 heads do not divide mamba_expand * hidden_size: BambaConfig refuses the config, and
    # kvspec's own typing and plugins then judge the file's fields.
    normalized = normalize_config({**bamba(), "mamba_n_heads": 100, "mamba_d_head": "auto"})
    assert normalized.defaults_from == DEFAULTS_FROM_KVSPEC
    assert "refused the config" in (normalized.defaults_note or "")


def test_absurd_layer_counts_never_reach_transformers() -> None:
    normalized = normalize_config({**bamba(), "num_hidden_layers": 10**12})
    assert "beyond kvspec's limits" in (normalized.defaults_note or "")
    with pytest.raises(ConfigError, match="'num_hidden_layers' is 1000000000000"):
        type_string({**bamba(), "num_hidden_layers": 10**12})


# Model dtype ----------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["torch_dtype", "dtype"])
@pytest.mark.parametrize("transformers_installed", [True, False])
def test_the_configs_dtype_reaches_the_mamba_states_and_attention(
    field: str,
    transformers_installed: bool,
    kvspec_loaded_manager: PluginManager,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not transformers_installed:
        monkeypatch.setitem(sys.modules, "transformers", None)
    config = {k: v for k, v in bamba().items() if k != "torch_dtype"}
    config[field] = "float16"
    result = plan(config, kvspec_loaded_manager)
    assert result.model.source.dtype == torch.float16
    assert result.model.source.dtype_field == field
    states = [s for s in result.specs.values() if s.kind == "mamba"]
    assert {s.dtypes for s in states} == {(torch.float16, torch.float16)}
    attention = [s for s in result.specs.values() if s.kind == "full_attention"]
    assert {s.dtype for s in attention} == {torch.float16}


def test_outer_dtype_reaches_a_nested_text_config(kvspec_loaded_manager: PluginManager) -> None:
    config = {**gemma3(), "torch_dtype": "float16"}
    result = plan(config, kvspec_loaded_manager)
    assert result.model.source.dtype == torch.float16
    assert {s.dtype for s in result.specs.values()} == {torch.float16}


def test_no_dtype_anywhere_plans_in_bfloat16(kvspec_loaded_manager: PluginManager) -> None:
    config = {k: v for k, v in bamba().items() if k != "torch_dtype"}
    normalized = normalize_config(config)
    assert normalized.dtype == torch.bfloat16 and normalized.dtype_field is None
    states = [s for s in plan(config, kvspec_loaded_manager).specs.values() if s.kind == "mamba"]
    assert {s.dtypes for s in states} == {(torch.bfloat16, torch.bfloat16)}


def test_the_default_length_is_vllms_rope_scaling_included(
    kvspec_loaded_manager: PluginManager,
) -> None:
    """Found in review: the default max_model_len ignored a linear / dynamic RoPE factor
    that vLLM's _get_and_verify_max_len multiplies in (and that the trained-length check
    already applied), and LongRoPE's default is its original length in vLLM."""
    base = {
        "model_type": "a_model_kvspec_never_heard_of",
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "max_position_embeddings": 4096,
    }
    lengths = {
        "none": base,
        "linear": {**base, "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
        "dynamic": {**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
        "llama3": {**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
        "longrope": {
            **base,
            "original_max_position_embeddings": 1024,
            "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0]},
        },
    }
    planned = {
        name: prepare_model(config, PlanOptions(), kvspec_loaded_manager).context.max_model_len
        for name, config in lengths.items()
    }
    assert planned == {
        "none": 4096,
        "linear": 16384,
        "dynamic": 8192,
        "llama3": 4096,
        "longrope": 1024,
    }


def test_the_default_length_reads_vllms_length_fields(
    kvspec_loaded_manager: PluginManager,
) -> None:
    """Found in review: GLM's seq_length, MPT's max_seq_len and Command-R's model_max_length
    were not read (no default length, or a shorter one than vLLM's)."""
    base = {
        "model_type": "a_model_kvspec_never_heard_of",
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "num_attention_heads": 4,
    }
    lengths = {
        "glm": {**base, "seq_length": 131072},
        "mpt": {**base, "max_seq_len": 2048},
        "smallest": {**base, "max_position_embeddings": 8192, "seq_length": 4096},
        "command_r": {**base, "max_position_embeddings": 8192, "model_max_length": 131072},
    }
    planned = {
        name: prepare_model(config, PlanOptions(), kvspec_loaded_manager).context.max_model_len
        for name, config in lengths.items()
    }
    assert planned == {"glm": 131072, "mpt": 2048, "smallest": 4096, "command_r": 131072}
    with pytest.raises(ConfigError, match=r"declares no length \(max_position_embeddings"):
        prepare_model(base, PlanOptions(), kvspec_loaded_manager)
