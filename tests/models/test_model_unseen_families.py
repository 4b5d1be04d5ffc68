"""Configs of real model families the project never bundled plan without code changes.

Each config below is written with the fields its published ``config.json`` uses (values of
Gemma-3-4B-it, Granite-4.0-H-Small and Falcon-H1-0.5B). Granite-4.0-H is typed from its
fields alone. Gemma-3's published config omits fields whose defaults live in its config class,
so it relies on the published-defaults table; Falcon-H1's parallel attention + Mamba layers
are typed by its ``model_type``, as its modeling code builds both mixers in every layer
without a config field saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvspec_core.arithmetic import cdiv
from kvspec_core.cli.main import main
from kvspec_core.context import SizingContext
from kvspec_core.models.planning import plan_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

BUDGET = 40 << 30

#: Gemma-3-4B-it: multimodal, language model nested in text_config, which (as published)
#: gives neither the sliding pattern nor max_position_embeddings: Gemma3TextConfig's defaults
#: (a global layer every 6th, 131072 positions) apply.
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "initializer_range": 0.02,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 34,
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
    },
}

_GRANITE_ATTENTION = (5, 15, 25, 35)
#: Granite-4.0-H-Small: Mamba-2 + attention hybrid typed by ``layer_types`` with the values
#: ``mamba`` / ``attention``; Mamba fields spelled ``mamba_n_heads``, ``mamba_d_head``...
GRANITE_4_H_SMALL = {
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "attention_bias": False,
    "attention_multiplier": 0.0078125,
    "embedding_multiplier": 12,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 512,
    "layer_types": ["attention" if i in _GRANITE_ATTENTION else "mamba" for i in range(40)],
    "logits_scaling": 16,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 128,
    "mamba_proj_bias": False,
    "max_position_embeddings": 131072,
    "model_type": "granitemoehybrid",
    "num_attention_heads": 32,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "num_local_experts": 72,
    "position_embedding_type": "nope",
    "rope_theta": 10000,
    "torch_dtype": "bfloat16",
    "vocab_size": 100352,
}


#: Falcon-H1-0.5B: a parallel hybrid, attention and a Mamba-2 mixer side by side in every layer.
FALCON_H1_0_5B = {
    "architectures": ["FalconH1ForCausalLM"],
    "attention_bias": False,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "mamba_chunk_size": 128,
    "mamba_conv_bias": True,
    "mamba_d_conv": 4,
    "mamba_d_head": 64,
    "mamba_d_ssm": 1536,
    "mamba_d_state": 128,
    "mamba_expand": 2,
    "mamba_n_groups": 1,
    "mamba_n_heads": 24,
    "mamba_proj_bias": False,
    "max_position_embeddings": 16384,
    "model_type": "falcon_h1",
    "num_attention_heads": 8,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rope_theta": 100000000000.0,
    "torch_dtype": "bfloat16",
    "vocab_size": 32784,
}


def test_falcon_h1_plans_attention_and_mamba_in_every_layer(
    kvspec_loaded_manager: PluginManager,
) -> None:
    result = plan_model(
        FALCON_H1_0_5B, BUDGET, PlanOptions(), kvspec_loaded_manager, name="falcon-h1-0.5b"
    )
    kinds = [spec.kind for spec in result.specs.values()]
    assert kinds == ["full_attention", "mamba"] * 36
    mamba = result.specs["model.layers.0.mamba"]
    # conv (3, 1536 + 2 × 1 × 128) + ssm (24, 64, 128), bf16.
    assert mamba.page_size_bytes == (3 * (1536 + 256) + 24 * 64 * 128) * 2
    attention = result.specs["model.layers.0.self_attn"]
    assert attention.page_size_bytes == 16 * 2 * 128 * 2  # 2 KV heads × (64 + 64) × 2 B
    ideal = 36 * 16384 * 2 * 128 * 2 + 36 * 2 * mamba.page_size_bytes
    assert result.plan.max_concurrency * ideal <= BUDGET
    assert result.plan.max_concurrency >= 0.9 * (BUDGET / ideal)


def test_gemma3_plans_with_its_published_defaults(kvspec_loaded_manager: PluginManager) -> None:
    result = plan_model(GEMMA3_4B, BUDGET, PlanOptions(), kvspec_loaded_manager, name="gemma-3")
    kinds = [spec.kind for spec in result.specs.values()]
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    assert full == [5, 11, 17, 23, 29] and kinds.count("sliding_window") == 29
    assert result.context.max_model_len == 131072
    ctx = result.context
    sliding = result.specs["model.layers.0"]
    # window 1024: cdiv(1023 + 16384, 16) + 1 blocks; 4 KV heads × 256 × 2 × 2 B per token.
    assert sliding.max_blocks_per_request(ctx) == cdiv(1023 + 16384, 16) + 1 == 1089
    assert sliding.page_size_bytes == 16 * 4 * 512 * 2
    ideal = 5 * 131072 * 4096 + 29 * 1089 * 16 * 4096  # bytes one request needs, no padding
    plan = result.plan
    assert plan.max_concurrency * ideal <= BUDGET
    assert plan.max_concurrency >= 0.97 * (BUDGET / ideal)
    assert {group.block_size for group in plan.groups} == {16}


def test_granite_4_h_plans_as_a_mamba2_hybrid(kvspec_loaded_manager: PluginManager) -> None:
    result = plan_model(
        GRANITE_4_H_SMALL, BUDGET, PlanOptions(), kvspec_loaded_manager, name="granite-4.0-h-small"
    )
    kinds = {name: spec.kind for name, spec in result.specs.items()}
    assert [n for n, k in kinds.items() if k == "full_attention"] == [
        f"model.layers.{i}" for i in _GRANITE_ATTENTION
    ]
    assert sum(k == "mamba" for k in kinds.values()) == 36
    assert result.context.mamba_cache_mode == "align"
    # Mamba-2 state: conv (d_conv - 1, I + 2 × groups × d_state) + ssm (heads, head_dim,
    # d_state), I = heads × head_dim = 8192, bf16.
    state = (3 * (8192 + 2 * 1 * 128) + 128 * 64 * 128) * 2
    mamba = result.specs["model.layers.0"]
    assert mamba.page_size_bytes == state == 2_147_840
    long_ctx = SizingContext(max_model_len=1 << 20, mamba_cache_mode="align")
    assert mamba.max_memory_usage_bytes(long_ctx) == mamba.max_memory_usage_bytes(result.context)
    ideal = 4 * 131072 * 8 * 256 * 2 + 36 * 2 * mamba.page_size_bytes
    plan = result.plan
    assert plan.max_concurrency * ideal <= BUDGET
    assert plan.max_concurrency >= 0.9 * (BUDGET / ideal)
    assert {group.block_size for group in plan.groups} == {16}


def test_unseen_configs_plan_from_a_folder_through_the_cli(tmp_path: Path, capsys: object) -> None:
    for name, config in (("gemma3", GEMMA3_4B), ("granite", GRANITE_4_H_SMALL)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        assert main(["plan", str(folder), "--memory", "40GiB", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
        assert report["model"] == str(folder) and report["max_concurrency"] >= 1
        assert report["model_dtype"] == str(torch.bfloat16).removeprefix("torch.")


def test_gemma3_with_explicit_layer_types_plans_the_same(
    kvspec_loaded_manager: PluginManager,
) -> None:
    # Newer transformers write the derived fields out; then no default is needed at all.
    text = dict(
        GEMMA3_4B["text_config"],
        model_type="a_model_kvspec_never_heard_of",
        max_position_embeddings=131072,
        layer_types=[
            "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)
        ],
    )
    explicit = dict(GEMMA3_4B, model_type="another_unknown_model", text_config=text)
    # The length given: under a model_type that is not Gemma-3's, its linear RoPE factor 8
    # multiplies the default length, as vLLM's does (only gemma3 configs are exempt).
    by_default = plan_model(
        GEMMA3_4B, BUDGET, PlanOptions(), kvspec_loaded_manager, max_model_len=131072
    )
    by_fields = plan_model(
        explicit, BUDGET, PlanOptions(), kvspec_loaded_manager, max_model_len=131072
    )
    assert by_fields.specs == by_default.specs
    assert by_fields.plan.max_concurrency == by_default.plan.max_concurrency
