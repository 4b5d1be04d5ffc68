"""The plugin as the core sees it: registration, layer claims from a real config, the CLI."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest
from chunked_local_testkit import (
    llama4_config,
    manager_with_plugin,
)

import kvspec_chunked_local.plugin as chunked_local_plugin
from kvspec_chunked_local import ChunkedLocalAttentionSpec
from kvspec_core import PlanOptions, PluginManager, SizingContext
from kvspec_core.errors import ConfigError, MissingFamilyError
from kvspec_core.testing import kvspec_imports_outside, model_layer, plugins_cli_report

PLUGIN_ROOT = Path(__file__).resolve().parents[1]


def test_registering_into_a_fresh_manager_lists_the_kind() -> None:
    manager = PluginManager()
    info = manager.register(chunked_local_plugin, "chunked_local")
    assert info.spec_kinds == ("chunked_local_attention",)
    assert {"kvspec_register_spec_kinds", "kvspec_layer_spec"} <= set(info.hooks)
    assert manager.spec_kinds.class_of("chunked_local_attention") is ChunkedLocalAttentionSpec


def test_another_family_is_missing_and_named_with_its_install_line() -> None:
    manager = manager_with_plugin()
    with pytest.raises(MissingFamilyError, match="pip install kvspec-mla"):
        manager.spec_kinds.class_of("mla_attention")
    with pytest.raises(MissingFamilyError, match="pip install kvspec-sliding-window"):
        manager.spec_kinds.class_of("sliding_window")


def test_plugins_json_cli_lists_the_kind() -> None:
    report = plugins_cli_report("chunked_local")
    entries = {entry["name"]: entry for entry in report["plugins"]}
    assert entries["chunked_local"]["distribution"] == "kvspec-chunked-local"
    assert entries["chunked_local"]["spec_kinds"] == ["chunked_local_attention"]
    assert "kvspec_layer_spec" in entries["chunked_local"]["hooks"]


def test_no_source_or_test_imports_another_family_plugin() -> None:
    paths = [path for path in PLUGIN_ROOT.rglob("*.py") if "build" not in path.parts]
    assert not kvspec_imports_outside(paths, {"kvspec_core", "kvspec_chunked_local"})


def test_llama4_scout_chunked_layer() -> None:
    manager = manager_with_plugin()
    layer = model_layer(llama4_config(), 0, manager)
    assert layer.layer_type == "chunked_attention"
    ((plugin, spec),) = manager.layer_specs(layer)
    assert plugin == "chunked_local" and type(spec) is ChunkedLocalAttentionSpec
    assert (spec.attention_chunk_size, spec.num_kv_heads, spec.head_size, spec.block_size) == (
        8192,
        8,
        128,
        16,
    )
    assert spec.max_tp_shards == 8
    ctx = SizingContext(max_model_len=262144, max_in_flight_tokens=16384)
    assert spec.max_blocks_per_request(ctx) == 1536
    assert spec.max_memory_usage_bytes(ctx) == 1536 * 65536


def test_llama4_scout_at_tp4_block_64() -> None:
    layer = model_layer(
        llama4_config(),
        1,
        manager_with_plugin(),
        options=PlanOptions(block_size=64, tensor_parallel_size=4),
    )
    spec = chunked_local_plugin.kvspec_layer_spec(layer)
    assert (spec.num_kv_heads, spec.max_tp_shards, spec.block_size) == (2, 8, 64)
    assert spec.page_size_bytes == 64 * 2 * 256 * 2


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention", "mamba"])
def test_other_layer_types_are_left_to_other_families(layer_type: str) -> None:
    # A real layer relabelled: only the type tells the plugin to leave it.
    layer = attrs.evolve(model_layer(llama4_config(), 3, PluginManager()), layer_type=layer_type)
    assert chunked_local_plugin.kvspec_layer_spec(layer) is None


@pytest.mark.parametrize("chunk", [None, 0, -1, "8192", 8192.0, False])
def test_missing_or_invalid_chunk_names_field_and_layer(chunk: object) -> None:
    # The layer the core builds from the real config, then handed a broken chunk field (the
    # core would not type a layer as chunked from such a config in the first place).
    real = model_layer(llama4_config(), 5, PluginManager())
    config = dict(real.config, attention_chunk_size=chunk)
    with pytest.raises(ConfigError) as caught:
        manager_with_plugin().layer_specs(attrs.evolve(real, config=config))
    assert "'attention_chunk_size'" in str(caught.value)
    assert "model.layers.5" in str(caught.value)


def test_chunked_layer_without_attention_geometry_is_refused() -> None:
    layer = attrs.evolve(model_layer(llama4_config(), 2, PluginManager()), attention=None)
    with pytest.raises(ConfigError, match=re.escape("layers.2 is a chunked_attention layer")):
        chunked_local_plugin.kvspec_layer_spec(layer)
