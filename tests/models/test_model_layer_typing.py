"""Layer typing of every bundled preset and of each pattern field, against published code."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_testkit import preset, type_string, typed

from kvspec_core.errors import ConfigError
from kvspec_core.models.layer_typing import decoder_layer_types


def test_llama_qwen_are_full_attention_everywhere() -> None:
    assert type_string(preset("llama-3.1-8b")) == "F" * 32
    assert type_string(preset("llama-3.1-70b")) == "F" * 80
    assert type_string(preset("qwen3-8b")) == "F" * 36
    assert type_string(preset("qwen3-30b-a3b")) == "F" * 48


def test_qwen25_ignores_its_unused_sliding_window() -> None:
    config = preset("qwen2.5-7b")
    assert config["sliding_window"] == 131072 and config["use_sliding_window"] is False
    assert type_string(config) == "F" * 28


def test_qwen2_with_sliding_enabled_slides_from_max_window_layers_on() -> None:
    config = {**preset("qwen2.5-7b"), "use_sliding_window": True, "max_window_layers": 20}
    assert type_string(config) == "F" * 20 + "S" * 8


def test_mistral_and_phi3_slide_on_every_layer() -> None:
    assert type_string(preset("mistral-7b")) == "S" * 32
    assert type_string(preset("phi-3-mini")) == "S" * 32


def test_gemma2_alternates_starting_with_a_sliding_layer() -> None:
    # HF Gemma2DecoderLayer: is_sliding = not bool(layer_idx % 2).
    assert type_string(preset("gemma-2-9b")) == "SF" * 21


def test_gpt_oss_follows_layer_types() -> None:
    config = preset("gpt-oss-20b")
    expected = "".join(
        {"sliding_attention": "S", "full_attention": "F"}[t] for t in config["layer_types"]
    )
    assert type_string(config) == expected == "SF" * 12


def test_deepseek_v2_lite_is_mla() -> None:
    assert type_string(preset("deepseek-v2-lite")) == "L" * 27


def test_llama4_scout_every_fourth_layer_is_global_nope() -> None:
    # The preset lacks no_rope_layers: Llama4TextConfig's default interval 4 applies.
    assert "no_rope_layers" not in preset("llama-4-scout")["text_config"]
    assert type_string(preset("llama-4-scout")) == "CCCF" * 12


def test_llama4_explicit_no_rope_layers_win() -> None:
    config = preset("llama-4-scout")
    flags = [0 if i in (0, 47) else 1 for i in range(48)]
    config["text_config"] = {**config["text_config"], "no_rope_layers": flags}
    assert type_string(config) == "F" + "C" * 46 + "F"


def test_jamba_attention_every_8th_from_offset_4() -> None:
    assert type_string(preset("jamba-1.5-mini")) == "MMMMFMMM" * 4


def test_jamba_published_defaults_apply_when_the_fields_are_absent() -> None:
    config = {
        k: v
        for k, v in preset("jamba-1.5-mini").items()
        if k not in ("attn_layer_period", "attn_layer_offset")
    }
    assert type_string(config) == "MMMMFMMM" * 4


def test_nemotron_h_pattern_drops_mlp_only_layers() -> None:
    config = preset("nemotron-h-56b")
    pattern = config["hybrid_override_pattern"]
    layers = typed(config).layers
    kept = [i for i, c in enumerate(pattern) if c != "-"]
    assert [layer.index for layer in layers] == kept
    assert "".join("M" if c == "M" else "F" for c in pattern if c != "-") == type_string(config)
    assert type_string(config).count("F") == pattern.count("*") == 10
    assert len(layers) == 64 and layers[0].name == "model.layers.0"


def test_qwen3_next_every_fourth_layer_is_full() -> None:
    assert type_string(preset("qwen3-next-80b")) == "NNNF" * 12


def test_whisper_has_encoder_self_and_cross_layers() -> None:
    model = typed(preset("whisper-large-v3"))
    assert type_string(preset("whisper-large-v3")) == "E" * 32 + "FX" * 32
    names = [layer.name for layer in model.layers]
    assert names[32:34] == [
        "model.decoder.layers.0.self_attn",
        "model.decoder.layers.0.encoder_attn",
    ]
    assert model.default_max_model_len == 448 and model.max_encoder_tokens == 1500


def test_minimax_attn_type_list() -> None:
    config = {
        "num_hidden_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "attn_type_list": [0, 0, 0, 1, 0, 0, 0, 1],
    }
    assert type_string(config) == "NNNFNNNF"


def test_granite_style_layer_types_values_are_normalised() -> None:
    config = {
        "num_hidden_layers": 4,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "layer_types": ["mamba", "attention", "mamba2", "sliding_attention"],
        "sliding_window": 64,
    }
    assert type_string(config) == "MFMS"


def test_unknown_layer_types_pass_through_unchanged() -> None:
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "layer_types": ["conv", "full_attention"],
    }
    layers = typed(config).layers
    assert [layer.layer_type for layer in layers] == ["conv", "full_attention"]
    assert layers[1].attention is not None


def test_mla_with_sliding_layers_becomes_sliding_mla() -> None:
    config = {
        "num_hidden_layers": 2,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    assert [layer.layer_type for layer in typed(config).layers] == [
        "sliding_mla_attention",
        "mla_attention",
    ]


@pytest.mark.parametrize(
    "config, message",
    [
        ({"hidden_size": 8, "num_attention_heads": 1}, "'num_hidden_layers' is missing"),
        ({"num_hidden_layers": 10**12}, r"'num_hidden_layers' is 1000000000000.*\[1, 10000\]"),
        ({"num_hidden_layers": -3}, "'num_hidden_layers' is -3"),
        ({"num_hidden_layers": 3, "layer_types": ["full_attention"]}, "one entry per layer"),
        (
            {"num_hidden_layers": 2, "layer_types": ["full_attention", 7]},
            r"'layer_types'\[1\] is 7",
        ),
        ({"num_hidden_layers": 2, "hybrid_override_pattern": "M?"}, "has '\\?' at layer 1"),
        ({"num_hidden_layers": 2, "attn_type_list": [0, 2]}, r"'attn_type_list'\[1\] is 2"),
        (
            {"num_hidden_layers": 4, "attn_layer_period": 4, "attn_layer_offset": 4},
            "'attn_layer_offset' is 4",
        ),
        ({"num_hidden_layers": 4, "full_attention_interval": 0}, "'full_attention_interval' is 0"),
        (
            {"num_hidden_layers": 4, "attention_chunk_size": 8, "no_rope_layers": [1, 1, 2, 0]},
            "'no_rope_layers' must hold 0",
        ),
    ],
)
def test_bad_typing_fields_are_refused_by_name(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decoder_layer_types(config)


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 200), pattern=st.integers(1, 12), window=st.integers(1, 1 << 20))
def test_sliding_window_pattern_leaves_every_pattern_th_layer_global(
    layers: int, pattern: int, window: int
) -> None:
    config = {
        "num_hidden_layers": layers,
        "sliding_window": window,
        "sliding_window_pattern": pattern,
    }
    types = decoder_layer_types(config)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    assert full == [i for i in range(layers) if (i + 1) % pattern == 0]
    assert types.count("sliding_attention") == layers - layers // pattern


@settings(max_examples=40, deadline=None)
@given(layers=st.integers(1, 200), period=st.integers(1, 16), data=st.data())
def test_attn_layer_period_puts_attention_at_the_offset(
    layers: int, period: int, data: st.DataObject
) -> None:
    offset = data.draw(st.integers(0, period - 1))
    types = decoder_layer_types(
        {"num_hidden_layers": layers, "attn_layer_period": period, "attn_layer_offset": offset}
    )
    assert [i for i, t in enumerate(types) if t == "full_attention"] == list(
        range(offset, layers, period)
    )
    assert all(t == "mamba" for i, t in enumerate(types) if i % period != offset)


def test_falcon_h1_layers_hold_attention_and_mamba_side_by_side() -> None:
    config = {
        "model_type": "falcon_h1",
        "num_hidden_layers": 3,
        "hidden_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
    }
    layers = typed(config).layers
    assert [(layer.index, layer.name, layer.layer_type) for layer in layers[:2]] == [
        (0, "model.layers.0.self_attn", "full_attention"),
        (0, "model.layers.0.mamba", "mamba"),
    ]
    assert type_string(config) == "FM" * 3


@pytest.mark.parametrize("model_type", ["qwen2", "qwen2_moe", "qwen3", "qwen3_moe"])
def test_qwen_configs_without_use_sliding_window_do_not_slide(model_type: str) -> None:
    # Qwen2Config / Qwen3Config (and their MoE variants) default use_sliding_window=False and
    # then drop sliding_window, so a config that omits the switch runs full attention.
    config = {k: v for k, v in preset("qwen2.5-7b").items() if k != "use_sliding_window"}
    config["model_type"] = model_type
    assert type_string(config) == "F" * 28


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_qwen_sliding_without_max_window_layers_starts_at_the_published_28(
    model_type: str,
) -> None:
    # The same config classes default max_window_layers=28: layers 28.. slide.
    config = {k: v for k, v in preset("qwen2.5-7b").items() if k != "max_window_layers"}
    config.update(model_type=model_type, use_sliding_window=True, num_hidden_layers=32)
    assert type_string(config) == "F" * 28 + "S" * 4


def test_qwen3_moe_sliding_is_refused_where_its_model_code_slides_every_layer() -> None:
    # Qwen3MoeConfig also defaults max_window_layers=28, but transformers' Qwen3-MoE code
    # gives every layer the window: the two readings differ, so kvspec refuses to guess.
    config = {k: v for k, v in preset("qwen2.5-7b").items() if k != "max_window_layers"}
    config.update(model_type="qwen3_moe", use_sliding_window=True, num_hidden_layers=32)
    with pytest.raises(
        ConfigError,
        match=(
            r"disagrees with transformers' Qwen3MoeForCausalLM at layer 0: kvspec reads "
            r"full_attention, the model code builds sliding_attention \(window 131072\)"
        ),
    ):
        type_string(config)


def test_qwen2_moe_sliding_layers_follow_transformers_own_rule() -> None:
    # Qwen2MoeConfig builds its layer_types differently from Qwen2Config: even layers below
    # max_window_layers (default 28) slide. Engines read those layer_types, so kvspec does.
    config = {k: v for k, v in preset("qwen2.5-7b").items() if k != "max_window_layers"}
    config.update(model_type="qwen2_moe", use_sliding_window=True, num_hidden_layers=32)
    assert type_string(config) == "SF" * 14 + "F" * 4


@pytest.mark.parametrize("value", ["false", 0, 1, "yes"])
def test_use_sliding_window_must_be_a_bool(value: object) -> None:
    config = {**preset("mistral-7b"), "use_sliding_window": value}
    with pytest.raises(ConfigError, match=r"'use_sliding_window' is .*true or false"):
        typed(config)
