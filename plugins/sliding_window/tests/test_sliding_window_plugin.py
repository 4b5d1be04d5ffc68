"""The plugin as the core sees it: registration, layer claims from real configs, the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
import torch
from sliding_window_testkit import load_config, manager_with_plugin

import kvspec_sliding_window.plugin as sliding_window_plugin
from kvspec_core import PlanOptions, PluginManager, SizingContext
from kvspec_core.errors import ConfigError, MissingFamilyError
from kvspec_core.testing import kvspec_imports_outside, model_layer, plugins_cli_report
from kvspec_sliding_window import SlidingWindowSpec

KINDS = ["kpool_tail", "reference_sliding_window", "sliding_window"]
PLUGIN_ROOT = Path(__file__).resolve().parents[1]


def test_registering_into_a_fresh_manager_lists_the_kinds() -> None:
    manager = PluginManager()
    info = manager.register(sliding_window_plugin, "sliding_window")
    assert list(info.spec_kinds) == KINDS
    assert {"kvspec_register_spec_kinds", "kvspec_layer_spec"} <= set(info.hooks)
    for kind in KINDS:
        assert manager.spec_kinds.owner_of(kind) == "sliding_window"
    assert manager.spec_kinds.class_of("sliding_window") is SlidingWindowSpec


def test_unregistering_removes_every_kind() -> None:
    manager = manager_with_plugin()
    manager.unregister("sliding_window")
    for kind in KINDS:
        with pytest.raises(MissingFamilyError, match="pip install kvspec-sliding-window"):
            manager.spec_kinds.class_of(kind)


def test_another_family_is_missing_and_named_with_its_install_line() -> None:
    manager = manager_with_plugin()
    with pytest.raises(MissingFamilyError, match="pip install kvspec-mla"):
        manager.spec_kinds.class_of("mla_attention")
    with pytest.raises(MissingFamilyError, match="pip install kvspec-mamba"):
        manager.spec_kinds.class_of("mamba")


def test_plugins_json_cli_lists_the_kinds() -> None:
    report = plugins_cli_report("sliding_window")
    entries = {entry["name"]: entry for entry in report["plugins"]}
    entry = entries["sliding_window"]
    assert entry["distribution"] == "kvspec-sliding-window"
    assert entry["spec_kinds"] == KINDS
    assert "kvspec_layer_spec" in entry["hooks"]


def test_no_source_or_test_imports_another_family_plugin() -> None:
    paths = [path for path in PLUGIN_ROOT.rglob("*.py") if "build" not in path.parts]
    assert not kvspec_imports_outside(paths, {"kvspec_core", "kvspec_sliding_window"})


# --------------------------------------------------------------------------- layer claims
@pytest.mark.parametrize(
    "name, index, window, kv_heads, head_size",
    [
        ("mistralai__Mistral-7B-v0.1", 0, 4096, 8, 128),
        ("microsoft__Phi-3-mini-4k-instruct", 5, 2047, 32, 96),
        ("google__gemma-2-9b-it", 0, 4096, 8, 256),
        ("openai__gpt-oss-20b", 2, 128, 8, 64),
    ],
)
def test_sliding_layers_of_real_models(
    name: str, index: int, window: int, kv_heads: int, head_size: int
) -> None:
    manager = manager_with_plugin()
    layer = model_layer(load_config(name), index, manager)
    assert layer.layer_type == "sliding_attention"
    claims = manager.layer_specs(layer)
    assert [plugin for plugin, _ in claims] == ["sliding_window"]
    spec = claims[0][1]
    assert type(spec) is SlidingWindowSpec
    assert (spec.sliding_window, spec.num_kv_heads, spec.head_size, spec.head_size_v) == (
        window,
        kv_heads,
        head_size,
        head_size,
    )
    assert spec.max_tp_shards == kv_heads and spec.block_size == 16
    assert spec.extra_retained_tokens == 0 and spec.dcp_sharded


def test_gpt_oss_sliding_layer_at_tp2_with_block_32() -> None:
    manager = manager_with_plugin()
    layer = model_layer(
        load_config("openai__gpt-oss-20b"),
        0,
        manager,
        options=PlanOptions(block_size=32, tensor_parallel_size=2),
    )
    ((_, spec),) = manager.layer_specs(layer)
    assert (spec.num_kv_heads, spec.max_tp_shards, spec.block_size) == (4, 8, 32)
    assert spec.page_size_bytes == 32 * 4 * (64 + 64) * 2
    ctx = SizingContext(max_model_len=131072, max_in_flight_tokens=16384)
    assert spec.max_blocks_per_request(ctx) == (127 + 16384 + 31) // 32 + 1 == 517


@pytest.mark.parametrize(
    "layer_type",
    ["full_attention", "chunked_attention", "mamba", "mla_attention", "linear_attention"],
)
def test_other_layer_types_are_left_to_other_families(layer_type: str) -> None:
    # A real sliding layer relabelled: only the type tells the plugin to leave it.
    real = model_layer(load_config("mistralai__Mistral-7B-v0.1"), 0, PluginManager())
    layer = attrs.evolve(real, layer_type=layer_type)
    assert sliding_window_plugin.kvspec_layer_spec(layer) is None


@pytest.mark.parametrize("window", [None, 0, -4096, "4096", 4096.0, True, [4096, 4096]])
def test_missing_or_invalid_window_names_field_and_layer(window: object) -> None:
    config = load_config("mistralai__Mistral-7B-v0.1")
    # The core would not type a layer without a valid window as sliding, so the bad value is
    # put into the config of a layer it did build.
    real = model_layer(config, 7, PluginManager())
    layer = attrs.evolve(real, config=dict(real.config, sliding_window=window))
    with pytest.raises(ConfigError) as caught:
        manager_with_plugin().layer_specs(layer)
    assert "'sliding_window'" in str(caught.value) and "model.layers.7" in str(caught.value)


def test_sliding_layer_without_attention_geometry_is_refused() -> None:
    layer = attrs.evolve(
        model_layer(load_config("mistralai__Mistral-7B-v0.1"), 3, PluginManager()),
        attention=None,
    )
    with pytest.raises(ConfigError, match=re.escape("model.layers.3 is a sliding_attention layer")):
        sliding_window_plugin.kvspec_layer_spec(layer)


def test_quantised_cache_dtype_flows_into_the_spec() -> None:
    manager = manager_with_plugin()
    fp8 = manager.kv_dtypes.get("fp8")
    layer = model_layer(
        load_config("mistralai__Mistral-7B-v0.1"),
        0,
        manager,
        options=PlanOptions(kv_cache_dtype="fp8"),
    )
    assert layer.attention.kv_cache_dtype == "fp8"
    spec = sliding_window_plugin.kvspec_layer_spec(layer)
    assert spec.kv_quant_mode == fp8.quant_mode
    assert spec.page_size_bytes == 16 * 8 * 256 * 1 and spec.dtype == torch.float8_e4m3fn
