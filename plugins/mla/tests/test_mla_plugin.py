"""kvspec-mla as a plugin: registration, the layer hook on a real config, isolation, CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mla_testkit import load_config, manager_with_mla, mla_layer

import kvspec_mla.plugin as mla_plugin
from kvspec_core import AttentionShape, PlanOptions, PluginManager
from kvspec_core.errors import ConfigError, MissingFamilyError
from kvspec_core.kv_dtypes import BUILTIN_QUANT_MODES
from kvspec_core.testing import (
    kvspec_imports_outside,
    model_layer,
    model_layers_of,
    plugins_cli_report,
)
from kvspec_mla import MLAAttentionSpec, SlidingWindowMLASpec

MLA_KINDS = ["circular_buffer", "hidden_state_cache", "mla_attention", "sliding_window_mla"]


# --------------------------------------------------------------------------- registration
def test_registration_lists_the_kinds_and_the_dtype() -> None:
    manager = PluginManager()
    info = manager.register(mla_plugin, "mla")
    assert list(info.spec_kinds) == MLA_KINDS
    assert set(info.hooks) == {
        "kvspec_register_spec_kinds",
        "kvspec_register_kv_dtypes",
        "kvspec_register_runtime_rules",
        "kvspec_layer_spec",
    }
    for kind in MLA_KINDS:
        assert manager.spec_kinds.owner_of(kind) == "mla"
    fp8_ds_mla = manager.kv_dtypes.get("fp8_ds_mla")
    assert fp8_ds_mla.storage_dtype == torch.uint8
    assert manager.kv_dtypes.owner_of("fp8_ds_mla") == "mla"
    # nvfp4_ds_mla is a core name; the plugin does not take it over.
    assert manager.kv_dtypes.owner_of("nvfp4_ds_mla") == "core"


def test_unregistering_removes_everything() -> None:
    manager = manager_with_mla()
    manager.unregister("mla")
    assert not any(kind in manager.spec_kinds for kind in MLA_KINDS)
    with pytest.raises(Exception, match="unknown KV cache dtype 'fp8_ds_mla'"):
        manager.kv_dtypes.get("fp8_ds_mla")


def test_a_manager_without_mamba_names_its_distribution() -> None:
    manager = manager_with_mla()
    with pytest.raises(MissingFamilyError, match="pip install kvspec-mamba"):
        manager.spec_kinds.class_of("mamba")


def test_plugins_cli_json_shows_the_kinds() -> None:
    report = plugins_cli_report("mla,sliding_window")
    (entry,) = [plugin for plugin in report["plugins"] if plugin["name"] == "mla"]
    assert entry["distribution"] == "kvspec-mla"
    assert entry["version"] == "0.1.0"
    assert entry["spec_kinds"] == MLA_KINDS
    assert not [failure for failure in report["failed"] if failure["name"] == "mla"]


def test_tests_import_no_plugin_but_the_declared_dependency() -> None:
    allowed = {"kvspec_core", "kvspec_mla", "kvspec_sliding_window"}
    assert not kvspec_imports_outside(Path(__file__).parent.glob("*.py"), allowed)


# --------------------------------------------------------------------------- layer hook
def test_deepseek_v2_lite_stores_576_values_x_2_bytes_x_27_layers_per_token() -> None:
    config = load_config()
    manager = manager_with_mla()
    specs = []
    for layer in model_layers_of(config, manager):
        ((owner, spec),) = manager.layer_specs(layer)
        assert owner == "mla"
        specs.append(spec)
    assert len(specs) == 27
    spec = specs[0]
    assert isinstance(spec, MLAAttentionSpec) and type(spec) is MLAAttentionSpec
    assert (spec.head_size, spec.head_size_v, spec.num_kv_heads) == (576, 0, 1)
    assert spec.max_tp_shards == 1
    assert spec.dtype == torch.bfloat16 and spec.cache_dtype_str is None
    merged = MLAAttentionSpec.merge(specs, [f"model.layers.{i}" for i in range(27)])
    assert merged == spec
    bytes_per_token = sum(s.page_size_bytes for s in specs) // 16
    assert bytes_per_token == 576 * 2 * 27 == 31104


def test_the_latent_is_replicated_across_tensor_parallelism() -> None:
    config = load_config()
    for tp in (1, 2, 8, 16):
        layer = model_layer(
            config, 0, manager_with_mla(), options=PlanOptions(tensor_parallel_size=tp)
        )
        spec = mla_plugin.kvspec_layer_spec(layer)
        assert (spec.num_kv_heads, spec.max_tp_shards) == (1, 1)
        assert spec.page_size_bytes == 16 * 576 * 2


@pytest.mark.parametrize(
    "kv_cache_dtype, dtype, cache_dtype_str, per_token",
    [
        ("auto", torch.bfloat16, None, 1152),
        ("bfloat16", torch.bfloat16, None, 1152),
        ("float32", torch.float32, None, 2304),
        ("fp8", torch.float8_e4m3fn, None, 576),
        ("fp8_ds_mla", torch.uint8, "fp8_ds_mla", 656),
        ("nvfp4_ds_mla", torch.uint8, "nvfp4_ds_mla", 352),
    ],
)
def test_kv_cache_dtype_choice(
    kv_cache_dtype: str, dtype: torch.dtype, cache_dtype_str: str | None, per_token: int
) -> None:
    options = PlanOptions(block_size=64, kv_cache_dtype=kv_cache_dtype)
    spec = mla_plugin.kvspec_layer_spec(
        model_layer(load_config(), 0, manager_with_mla(), options=options)
    )
    assert spec.dtype == dtype
    assert spec.cache_dtype_str == cache_dtype_str
    assert spec.page_size_bytes == 64 * per_token


def test_the_cores_resolved_dtype_is_used_when_given() -> None:
    fp8 = next(mode for mode in BUILTIN_QUANT_MODES if mode.name == "fp8_per_tensor")
    shape = AttentionShape(
        num_kv_heads=16,
        total_kv_heads=16,
        head_size=192,
        head_size_v=128,
        dtype=torch.float8_e5m2,
        kv_quant_mode=fp8,
        kv_cache_dtype="fp8_e5m2",
    )
    spec = mla_plugin.kvspec_layer_spec(
        mla_layer(load_config(), kv_cache_dtype="fp8_e5m2", attention=shape)
    )
    # Dtype and quant mode come from the core; heads and sizes from the latent, not from
    # the config's per-head attention geometry.
    assert (spec.dtype, spec.kv_quant_mode) == (torch.float8_e5m2, fp8)
    assert (spec.num_kv_heads, spec.head_size, spec.head_size_v) == (1, 576, 0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("kv_lora_rank", None),
        ("kv_lora_rank", 0),
        ("kv_lora_rank", "512"),
        ("qk_rope_head_dim", None),
        ("qk_rope_head_dim", -64),
        ("qk_rope_head_dim", True),
    ],
)
def test_missing_latent_fields_are_refused_naming_field_and_layer(
    field: str, value: object
) -> None:
    config = load_config()
    if value is None:
        del config[field]
    else:
        config[field] = value
    with pytest.raises(ConfigError) as caught:
        mla_plugin.kvspec_layer_spec(mla_layer(config, index=3))
    assert repr(field) in str(caught.value)
    assert "model.layers.3" in str(caught.value)


def test_other_layer_types_are_left_to_other_families() -> None:
    config = load_config()
    for layer_type in ("full_attention", "sliding_attention", "mamba", "cross_attention"):
        assert mla_plugin.kvspec_layer_spec(mla_layer(config, layer_type=layer_type)) is None


def test_sliding_mla_layers() -> None:
    config = {**load_config(), "sliding_window": 128}
    spec = mla_plugin.kvspec_layer_spec(
        mla_layer(config, layer_type="sliding_mla_attention", kv_cache_dtype="fp8_ds_mla")
    )
    assert isinstance(spec, SlidingWindowMLASpec)
    assert (spec.sliding_window, spec.head_size, spec.page_size_bytes) == (128, 576, 16 * 656)
    del config["sliding_window"]
    with pytest.raises(
        ConfigError,
        match=r"'sliding_window'.*model.layers.0"
        r"|model.layers.0.*'sliding_window'",
    ):
        mla_plugin.kvspec_layer_spec(mla_layer(config, layer_type="sliding_mla_attention"))


def test_unknown_cache_dtype_without_a_resolved_shape_is_refused() -> None:
    with pytest.raises(ConfigError, match="int2_magic"):
        mla_plugin.kvspec_layer_spec(mla_layer(load_config(), kv_cache_dtype="int2_magic"))
