"""Attention geometry per TP rank, head sizes, MLA latents and KV-cache dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_testkit import preset, typed

from kvspec_core.errors import ConfigError, UnknownNameError
from kvspec_core.models.attention_shape import kv_heads_per_rank


def test_llama_8b_shape() -> None:
    shape = typed(preset("llama-3.1-8b")).layers[0].attention
    assert shape is not None
    assert (shape.num_kv_heads, shape.total_kv_heads, shape.head_size, shape.head_size_v) == (
        8,
        8,
        128,
        128,
    )
    assert shape.dtype == torch.bfloat16 and not shape.replicated


def test_head_dim_field_wins_over_hidden_over_heads() -> None:
    # Gemma-2-9B: hidden 3584 / 16 heads = 224, but head_dim is 256.
    shape = typed(preset("gemma-2-9b")).layers[0].attention
    assert shape is not None and shape.head_size == 256
    # Nemotron-H names it attention_head_dim.
    nemotron = typed(preset("nemotron-h-56b"))
    attention = [layer for layer in nemotron.layers if layer.attention is not None]
    assert attention and all(layer.attention.head_size == 128 for layer in attention)


def test_kv_heads_default_to_attention_heads() -> None:
    config = {"num_hidden_layers": 1, "hidden_size": 1024, "num_attention_heads": 16}
    shape = typed(config).layers[0].attention
    assert shape is not None and shape.num_kv_heads == 16 and shape.head_size == 64


def test_mla_latent_is_one_replicated_head() -> None:
    layers = typed(preset("deepseek-v2-lite"), tensor_parallel_size=4).layers
    shape = layers[0].attention
    assert shape is not None
    assert (shape.num_kv_heads, shape.total_kv_heads, shape.head_size) == (1, 1, 512 + 64)
    assert shape.replicated


def test_state_layers_have_no_attention_shape() -> None:
    layers = typed(preset("jamba-1.5-mini")).layers
    assert all((layer.attention is None) == (layer.layer_type == "mamba") for layer in layers)


def test_tp_divides_kv_heads() -> None:
    shape = typed(preset("llama-3.1-8b"), tensor_parallel_size=4).layers[0].attention
    assert shape is not None and (shape.num_kv_heads, shape.total_kv_heads) == (2, 8)


def test_tp_beyond_kv_heads_replicates_one_head_per_rank() -> None:
    shape = typed(preset("qwen2.5-7b"), tensor_parallel_size=8).layers[0].attention
    assert shape is not None
    assert (shape.num_kv_heads, shape.total_kv_heads, shape.replicated) == (1, 4, True)


@pytest.mark.parametrize(
    "tp, message",
    [
        (3, r"'num_key_value_heads'=8 .* cannot be split evenly across tensor parallel size 3"),
        (12, r"tensor parallel size 12 exceeds config field 'num_key_value_heads'=8"),
    ],
)
def test_indivisible_tp_is_refused_naming_field_and_fix(tp: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        typed(preset("llama-3.1-8b"), tensor_parallel_size=tp)
    assert "use a --tp" in str(caught.value)


@settings(max_examples=60, deadline=None)
@given(total=st.integers(1, 128), tp=st.integers(1, 256))
def test_heads_per_rank_covers_every_head_exactly(total: int, tp: int) -> None:
    try:
        per_rank, replicated = kv_heads_per_rank(total, tp, "num_key_value_heads", "layer x")
    except ConfigError:
        assert (total % tp if tp <= total else tp % total) != 0
        return
    assert per_rank >= 1
    if replicated:
        assert tp > total and per_rank == 1 and tp % total == 0
    else:
        assert per_rank * tp == total


def test_kv_cache_dtype_auto_takes_the_model_dtype() -> None:
    shape = typed(preset("whisper-large-v3")).layers[0].attention
    assert shape is not None and shape.dtype == torch.float16


def test_missing_model_dtype_defaults_to_bfloat16() -> None:
    config = preset("gpt-oss-20b")
    assert "torch_dtype" not in config and "dtype" not in config
    assert typed(config).layers[0].model_dtype == torch.bfloat16


def test_multimodal_text_config_inherits_the_outer_dtype() -> None:
    config = preset("llama-4-scout")
    config["torch_dtype"] = "float16"
    del config["text_config"]["torch_dtype"]
    assert typed(config).layers[0].model_dtype == torch.float16


def test_fp8_kv_cache_dtype_is_resolved_through_the_registry() -> None:
    shape = typed(preset("llama-3.1-8b"), kv_cache_dtype="fp8").layers[0].attention
    assert shape is not None
    assert shape.dtype == torch.float8_e4m3fn
    assert shape.kv_quant_mode.name == "fp8_per_tensor" and shape.kv_cache_dtype == "fp8"


def test_unknown_kv_cache_dtype_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match=r"unknown KV cache dtype 'fp7'; known: .*fp8"):
        typed(preset("llama-3.1-8b"), kv_cache_dtype="fp7")


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"num_hidden_layers": 1, "hidden_size": 1000, "num_attention_heads": 3},
            "'hidden_size'=1000 is not a multiple of 'num_attention_heads'=3",
        ),
        # GPT-2 spellings: the message names the fields the config actually uses.
        (
            {"n_layer": 1, "n_embd": 1000, "n_head": 3},
            "'n_embd'=1000 is not a multiple of 'n_head'=3",
        ),
        ({"num_hidden_layers": 1, "hidden_size": 1024}, "'num_attention_heads' or 'n_head'"),
        (
            {
                "num_hidden_layers": 1,
                "hidden_size": 1024,
                "num_attention_heads": 8,
                "num_key_value_heads": 0,
            },
            "'num_key_value_heads' is 0",
        ),
        (
            {
                "num_hidden_layers": 1,
                "hidden_size": 1024,
                "num_attention_heads": 8,
                "torch_dtype": "float9",
            },
            "'torch_dtype': unknown torch dtype 'float9'",
        ),
        (
            {"num_hidden_layers": 1, "num_attention_heads": 8, "kv_lora_rank": 512},
            "'qk_rope_head_dim' is missing",
        ),
    ],
)
def test_bad_geometry_fields_are_refused_naming_the_layer(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        typed(config)
    if "dtype" not in message:
        assert "model.layers.0" in str(caught.value)


def test_packed_mla_formats_are_refused_on_non_mla_layers() -> None:
    # A *_ds_mla record packs one MLA latent (NoPE + RoPE + scales); a K/V head cache has no
    # such layout, so sizing it as raw bytes per element would be a number no engine uses.
    # (fp8_ds_mla is registered by kvspec-mla; the core's nvfp4_ds_mla takes the same path.)
    with pytest.raises(
        ConfigError,
        match=r"'nvfp4_ds_mla' is a packed MLA.*"
        r"layer model.layers.0 \(full_attention\)",
    ):
        typed(preset("llama-3.1-8b"), kv_cache_dtype="nvfp4_ds_mla")


def test_packed_mla_formats_stay_accepted_on_mla_layers() -> None:
    shape = typed(preset("deepseek-v2-lite"), kv_cache_dtype="nvfp4_ds_mla").layers[0].attention
    assert shape is not None and shape.head_size == 576


def test_indivisible_huge_kv_head_count_is_refused_promptly() -> None:
    # A hostile num_key_value_heads near the field limit must not make the error message
    # enumerate every candidate divisor one by one
    # (2**40 - 1 = 3 x 5^2 x 11 x 17 x 31 x 41 x 61681).
    with pytest.raises(ConfigError, match=r"use a --tp that divides 1099511627775 \(1, 3, 5, "):
        kv_heads_per_rank(2**40 - 1, 2, "num_key_value_heads", "layer x")


@settings(max_examples=40, deadline=None)
@given(total=st.integers(1, 5000), tp=st.integers(2, 64))
def test_listed_tp_choices_are_exactly_the_divisors(total: int, tp: int) -> None:
    if tp > total or total % tp == 0:
        return
    with pytest.raises(ConfigError) as caught:
        kv_heads_per_rank(total, tp, "num_key_value_heads", "layer x")
    listed = str(caught.value).split(f"divides {total} (")[1].split(")")[0]
    assert [int(d) for d in listed.split(", ")] == [
        d for d in range(1, total + 1) if total % d == 0
    ]


def test_an_mla_latent_beyond_the_field_limit_is_refused_naming_the_fields() -> None:
    config = {**preset("deepseek-v2-lite"), "kv_lora_rank": 2**40}
    with pytest.raises(
        ConfigError,
        match=r"'kv_lora_rank' \+ 'qk_rope_head_dim'.*"
        r"layer model.layers.0 \(mla_attention\)",
    ):
        typed(config)


def _shape_of(**fields: object) -> tuple[int, int]:
    config = {"num_hidden_layers": 1, "hidden_size": 4544, "num_attention_heads": 71, **fields}
    shape = typed(config).layers[0].attention
    assert shape is not None
    return shape.total_kv_heads, shape.head_size


def test_kv_heads_read_in_vllms_order_with_falcons_multi_query() -> None:
    """Found in review: Falcon-7B (multi_query) and ChatGLM (multi_query_group_num) were
    read as full multi-head attention (71x and 16x the KV), Falcon-40B's n_head_kv ignored.
    vLLM's get_total_num_kv_heads and the model code give 1, 8 and 2 KV heads."""
    falcon_7b = {"model_type": "falcon", "multi_query": True, "num_kv_heads": 71}
    assert _shape_of(**falcon_7b) == (1, 64)
    assert _shape_of(**falcon_7b, new_decoder_architecture=True) == (71, 64)
    falcon_40b = {"model_type": "falcon", "new_decoder_architecture": True, "n_head_kv": 8}
    assert _shape_of(hidden_size=8192, num_attention_heads=128, **falcon_40b) == (8, 64)
    glm = {"hidden_size": 4096, "num_attention_heads": 32, "multi_query_group_num": 2}
    assert _shape_of(**glm, multi_query_attention=True, kv_channels=128) == (2, 128)
    assert _shape_of(**glm, multi_query_attention=False) == (32, 128)


def test_dbrx_and_mpt_read_their_own_field_names() -> None:
    """Found in review: DBRX and MPT (``n_layers``, ``n_heads``, ``d_model`` and the KV heads
    in ``attn_config.kv_n_heads``) were refused for a missing ``num_hidden_layers``, and the
    fix it named led to a second refusal. vLLM reads their KV heads from ``attn_config``."""
    dbrx = {
        "model_type": "dbrx",
        "d_model": 6144,
        "n_heads": 48,
        "n_layers": 40,
        "attn_config": {"kv_n_heads": 8, "clip_qkv": 8, "rope_theta": 500000},
    }
    model = typed(dbrx)
    shape = model.layers[0].attention
    assert len(model.layers) == 40 and shape is not None
    assert (shape.total_kv_heads, shape.head_size) == (8, 128)
    # MPT without kv_n_heads: multi-head attention, one KV head per query head.
    mpt = {"model_type": "mpt", "d_model": 4096, "n_heads": 32, "n_layers": 32}
    shape = typed({**mpt, "attn_config": {"alibi": True}}).layers[0].attention
    assert shape is not None and (shape.total_kv_heads, shape.head_size) == (32, 128)
    shape = typed({**mpt, "attn_config": {"kv_n_heads": 8}}).layers[0].attention
    assert shape is not None and shape.total_kv_heads == 8
    with pytest.raises(ConfigError, match=r"'attn_config\.kv_n_heads' is '8'"):
        typed({**dbrx, "attn_config": {"kv_n_heads": "8", "rope_theta": 500000}})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        # Gemma-4: global layers sized from their own head fields.
        ({"global_head_dim": 512}, "'global_head_dim'"),
        ({"num_global_key_value_heads": 4}, "'num_global_key_value_heads'"),
        # MiMo-V2-Flash: V narrower than K outside MLA.
        ({"head_dim": 192, "v_head_dim": 128}, "'v_head_dim'=128 differs"),
        # JetMoE: kv_channels 128 where hidden / heads is 64.
        ({"hidden_size": 2048, "num_attention_heads": 32, "kv_channels": 128}, "'kv_channels'"),
    ],
)
def test_kv_widths_from_fields_kvspec_does_not_read_are_refused(
    fields: dict[str, object], message: str
) -> None:
    """Found in review: these configs were planned from the shared head fields, their caches
    sized 2x off against transformers' model code."""
    with pytest.raises(ConfigError, match=message):
        _shape_of(**fields)
    # The same widths stated consistently plan as before.
    assert _shape_of(head_dim=128, v_head_dim=128) == (71, 128)
    assert _shape_of(hidden_size=4096, num_attention_heads=32, kv_channels=128) == (32, 128)


@pytest.mark.parametrize("value", [-8, 0, 2.5, "8", True])
def test_an_unusable_head_field_is_named_before_the_model_code_is_built(value: object) -> None:
    # Found by review: with transformers, the model code check built the model from the
    # field first and answered with transformers' own error (a negative dimension, a
    # division by zero) and a fix that would not help (turning the check off).
    config = {**preset("llama-3.1-8b"), "num_key_value_heads": value}
    with pytest.raises(ConfigError, match=r"config field 'num_key_value_heads' is .* must be"):
        typed(config)
