"""State sizes of real hybrid models, as the published model code sizes them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mamba_testkit import (
    JAMBA,
    NEMOTRON_H_56B,
    QWEN3_NEXT,
    load_config,
    manager_with_plugin,
    nemotron_h_8b_config,
    state_layer,
)

import kvspec_mamba.plugin as mamba_plugin
from kvspec_core import PlanOptions, SizingContext
from kvspec_core.errors import ConfigError
from kvspec_core.testing import model_layer
from kvspec_mamba import MambaSpec, mamba_spec

BF16, FP32 = torch.bfloat16, torch.float32


def spec_of(config: dict[str, Any], layer_type: str = "mamba", **options: Any) -> MambaSpec:
    """The spec of a hand-built state layer (synthetic or deliberately invalid configs)."""
    spec = mamba_spec(state_layer(config, layer_type, **options))
    assert isinstance(spec, MambaSpec)
    return spec


def core_spec_of(
    config: dict[str, Any], layer_type: str = "mamba", *, block_size: int = 16, tp: int = 1
) -> MambaSpec:
    """The spec of the model's first layer as the core's ingestion builds it (Jamba,
    Nemotron-H and Qwen3-Next all start with a state layer)."""
    layer = model_layer(
        config,
        0,
        manager_with_plugin(),
        options=PlanOptions(block_size=block_size, tensor_parallel_size=tp),
    )
    assert layer.layer_type == layer_type
    spec = mamba_spec(layer)
    assert isinstance(spec, MambaSpec)
    return spec


# --------------------------------------------------------------------------- pinned facts
def test_jamba_1_5_mini() -> None:
    spec = core_spec_of(load_config(JAMBA))
    assert spec.shapes == ((3, 8192), (8192, 16))
    assert spec.dtypes == (BF16, BF16)
    assert spec.page_size_bytes == 311_296
    assert spec.mamba_type == "mamba1" and spec.block_size == 16


def test_nemotron_h_8b() -> None:
    spec = core_spec_of(nemotron_h_8b_config())
    assert spec.shapes == ((3, 10240), (128, 64, 128))
    assert spec.dtypes == (BF16, FP32)  # Nemotron-H keeps its SSM state in float32
    assert spec.page_size_bytes == 3 * 10240 * 2 + 128 * 64 * 128 * 4
    assert spec.mamba_type == "mamba2"


def test_nemotron_h_56b() -> None:
    spec = core_spec_of(load_config(NEMOTRON_H_56B))
    # I = 256 heads x 64 = 16384; conv channels I + 2 x 8 groups x 256 state = 20480.
    assert spec.shapes == ((3, 20480), (256, 64, 256))
    assert spec.dtypes == (BF16, FP32)
    assert spec.page_size_bytes == 16_900_096


def test_qwen3_next_80b() -> None:
    spec = core_spec_of(load_config(QWEN3_NEXT), "linear_attention")
    assert spec.shapes == ((3, 8192), (32, 128, 128))
    assert spec.dtypes == (BF16, BF16)
    assert spec.page_size_bytes == 3 * 8192 * 2 + 32 * 128 * 128 * 2 == 1_097_728
    assert spec.mamba_type == "gated_delta_net"


def test_block_size_is_the_requested_one_never_inflated() -> None:
    for block_size in (16, 64, 1024):
        spec = core_spec_of(load_config(NEMOTRON_H_56B), block_size=block_size)
        assert spec.block_size == block_size
        assert spec.page_size_bytes == 16_900_096


# --------------------------------------------------------------------------- tensor parallel
@pytest.mark.parametrize(
    "tp, shapes",
    [
        (2, ((3, 4096), (4096, 16))),
        (8, ((3, 1024), (1024, 16))),
    ],
)
def test_jamba_under_tp(tp: int, shapes: tuple) -> None:
    assert core_spec_of(load_config(JAMBA), tp=tp).shapes == shapes


@pytest.mark.parametrize(
    "tp, shapes",
    [
        (2, ((3, 8192 + 2 * 4 * 256), (128, 64, 256))),
        (8, ((3, 2048 + 2 * 1 * 256), (32, 64, 256))),
        # 16 ranks, 8 groups: each rank holds one replicated group.
        (16, ((3, 1024 + 2 * 1 * 256), (16, 64, 256))),
    ],
)
def test_nemotron_h_under_tp(tp: int, shapes: tuple) -> None:
    assert core_spec_of(load_config(NEMOTRON_H_56B), tp=tp).shapes == shapes


@pytest.mark.parametrize(
    "tp, shapes",
    [
        (2, ((3, 4096), (16, 128, 128))),
        (4, ((3, 2 * 4 * 128 + 8 * 128), (8, 128, 128))),
        (16, ((3, 2 * 1 * 128 + 2 * 128), (2, 128, 128))),
    ],
)
def test_qwen3_next_under_tp(tp: int, shapes: tuple) -> None:
    assert core_spec_of(load_config(QWEN3_NEXT), "linear_attention", tp=tp).shapes == shapes


@pytest.mark.parametrize(
    "name, layer_type, tp, field",
    [
        (JAMBA, "mamba", 3, "mamba_expand * hidden_size"),
        (NEMOTRON_H_56B, "mamba", 3, "mamba_num_heads"),
        (QWEN3_NEXT, "linear_attention", 32, "linear_num_key_heads"),
        (QWEN3_NEXT, "linear_attention", 3, "linear_num_key_heads"),
    ],
)
def test_indivisible_tp_is_refused_naming_the_field(
    name: str, layer_type: str, tp: int, field: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        spec_of(load_config(name), layer_type, tp=tp)
    message = str(caught.value)
    assert field in message and f"tensor_parallel_size={tp}" in message
    assert "model.layers.0" in message


def test_value_heads_not_a_multiple_of_key_heads_are_refused() -> None:
    config = dict(load_config(QWEN3_NEXT), linear_num_value_heads=24)
    with pytest.raises(ConfigError) as caught:
        spec_of(config, "linear_attention")
    message = str(caught.value)
    assert "linear_num_value_heads=24" in message and "linear_num_key_heads=16" in message
    assert "model.layers.0" in message


def test_groups_that_neither_divide_nor_are_divided_by_tp_are_refused() -> None:
    config = dict(load_config(NEMOTRON_H_56B), n_groups=3)
    with pytest.raises(ConfigError, match="n_groups=3 neither divides"):
        spec_of(config, tp=4)


# --------------------------------------------------------------------------- other layouts
def test_granite_4_h_field_names() -> None:
    # GraniteMoeHybrid (Granite-4.0-H) and Bamba name the Mamba-2 fields mamba_n_heads,
    # mamba_d_head, mamba_n_groups, mamba_d_state, mamba_d_conv, mamba_expand.
    config = dict(
        model_type="granitemoehybrid",
        hidden_size=4096,
        mamba_n_heads=128,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=128,
        mamba_d_conv=4,
        mamba_expand=2,
    )
    spec = spec_of(config)
    assert spec.shapes == ((3, 8192 + 2 * 128), (128, 64, 128))
    assert spec.dtypes == (BF16, BF16) and spec.mamba_type == "mamba2"
    # A single group is replicated on every rank.
    assert spec_of(config, tp=4).shapes == ((3, 2048 + 2 * 128), (32, 64, 128))


def test_falcon_h1_field_names_with_mamba_d_ssm_and_auto_head() -> None:
    config = dict(
        model_type="falcon_h1",
        hidden_size=2048,
        mamba_d_ssm=3072,
        mamba_n_heads=24,
        mamba_d_head="auto",
        mamba_n_groups=1,
        mamba_d_state=256,
        mamba_d_conv=4,
        mamba_expand=2,
    )
    assert spec_of(config).shapes == ((3, 3072 + 2 * 256), (24, 128, 256))


def test_minimax_lightning_attention_state() -> None:
    # MiniMax-Text-01 field names: 64 heads of 128, layers typed by attn_type_list.
    config = dict(
        model_type="minimax",
        hidden_size=6144,
        num_attention_heads=64,
        head_dim=128,
        num_hidden_layers=2,
        attn_type_list=[0, 1],
    )
    spec = spec_of(config, "linear_attention")
    assert spec.shapes == ((64, 128, 128),) and spec.dtypes == (BF16,)
    assert spec.mamba_type == "linear_attention"
    assert spec.page_size_bytes == 64 * 128 * 128 * 2
    assert spec_of(config, "linear_attention", tp=8).shapes == ((8, 128, 128),)
    with pytest.raises(ConfigError, match="num_attention_heads=64 is not divisible"):
        spec_of(config, "linear_attention", tp=3)


def test_inconsistent_mamba2_head_geometry_is_refused() -> None:
    config = dict(
        hidden_size=2048,
        mamba_d_ssm=3072,
        mamba_n_heads=24,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=256,
        mamba_d_conv=4,
    )
    with pytest.raises(ConfigError, match=r"mamba_n_heads=24 x mamba_d_head=64 != .* 3072"):
        spec_of(config)


# --------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize(
    "name, value, ssm_dtype",
    [
        (NEMOTRON_H_56B, "bfloat16", BF16),
        (NEMOTRON_H_56B, "auto", FP32),
        (JAMBA, "float32", FP32),
        (QWEN3_NEXT, "float16", torch.float16),
    ],
)
def test_ssm_dtype_from_the_config(name: str, value: str, ssm_dtype: torch.dtype) -> None:
    layer_type = "linear_attention" if name == QWEN3_NEXT else "mamba"
    spec = core_spec_of(dict(load_config(name), mamba_ssm_cache_dtype=value), layer_type)
    assert spec.dtypes == (BF16, ssm_dtype)


def test_conv_state_follows_the_model_dtype() -> None:
    spec = core_spec_of(dict(load_config(JAMBA), torch_dtype="float16"))
    assert spec.dtypes == (torch.float16, torch.float16)
    assert spec.page_size_bytes == 311_296


@pytest.mark.parametrize("value", ["float7", 32])
def test_invalid_ssm_dtype_is_refused(value: object) -> None:
    with pytest.raises(ConfigError, match="'mamba_ssm_cache_dtype'"):
        spec_of(dict(load_config(JAMBA), mamba_ssm_cache_dtype=value))


# --------------------------------------------------------------------------- bad configs
@pytest.mark.parametrize(
    "name, layer_type, field",
    [
        (JAMBA, "mamba", "mamba_d_conv"),
        (NEMOTRON_H_56B, "mamba", "mamba_head_dim"),
        (QWEN3_NEXT, "linear_attention", "linear_key_head_dim"),
    ],
)
def test_missing_field_is_refused_naming_it(name: str, layer_type: str, field: str) -> None:
    config = load_config(name)
    del config[field]
    with pytest.raises(ConfigError, match=f"'{field}'"):
        spec_of(config, layer_type)


def test_integral_float_sizes_are_read_as_ints() -> None:
    spec = core_spec_of(dict(load_config(JAMBA), mamba_expand=2.0))
    assert spec.shapes == ((3, 8192), (8192, 16))


@pytest.mark.parametrize("value", [0, -16, 16.5, "16", True, 1e300])
def test_invalid_field_is_refused_naming_it(value: object) -> None:
    with pytest.raises(ConfigError, match=r"model.layers.0: config field 'mamba_d_state' is"):
        spec_of(dict(load_config(JAMBA), mamba_d_state=value))


def test_unrecognised_state_layout_is_refused() -> None:
    with pytest.raises(ConfigError, match="state layout is not recognised"):
        spec_of({"hidden_size": 1024}, "linear_attention")


@pytest.mark.parametrize(
    "layer_type", ["full_attention", "sliding_attention", "chunked_attention", "mla_attention"]
)
def test_other_layer_types_are_left_to_other_families(layer_type: str) -> None:
    assert mamba_plugin.kvspec_layer_spec(state_layer(load_config(JAMBA), layer_type)) is None


# --------------------------------------------------------------------------- through the core
def test_the_manager_gets_exactly_one_claim() -> None:
    manager = manager_with_plugin()
    layer = model_layer(load_config(QWEN3_NEXT), 0, manager)
    assert layer.layer_type == "linear_attention"
    claims = manager.layer_specs(layer)
    assert [plugin for plugin, _ in claims] == ["mamba"]
    spec = claims[0][1]
    align = SizingContext(max_model_len=262144, mamba_cache_mode="align")
    assert spec.max_memory_usage_bytes(align) == 2 * 1_097_728
    assert spec.block_table_width(align, 262144) == 16384


@pytest.mark.parametrize(
    "name, layer_type, field",
    [
        (JAMBA, "mamba", "mamba_d_conv"),
        (NEMOTRON_H_56B, "mamba", "conv_kernel"),
        (QWEN3_NEXT, "linear_attention", "linear_conv_kernel_dim"),
    ],
)
def test_a_conv_kernel_below_two_is_refused_naming_it(
    name: str, layer_type: str, field: str
) -> None:
    # The conv state keeps kernel - 1 past inputs; a 1-wide kernel would make an empty state.
    with pytest.raises(ConfigError, match=rf"model.layers.0: config field '{field}' is 1.*>= 2"):
        spec_of(dict(load_config(name), **{field: 1}), layer_type)


def test_a_state_dimension_beyond_the_field_limit_is_refused_naming_the_layer() -> None:
    with pytest.raises(
        ConfigError,
        match=r"layer model.layers.0: .*state dimension "
        r"2251799813685248.*mamba_expand",
    ):
        spec_of(dict(load_config(JAMBA), mamba_expand=2**39))
