"""Layers to specs through the plugins: exactly one claim per layer, defaults of the context."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from model_testkit import preset

from kvspec_core.errors import ConfigError, MissingFamilyError, PluginError
from kvspec_core.models.ingest import default_sizing_context, layer_specs, model_layers
from kvspec_core.plugins.contract import CONTRACT_VERSION, hookimpl
from kvspec_core.plugins.layer_config import LayerConfig, PlanOptions
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs import FullAttentionSpec, KVSpec
from kvspec_core.testing import registered


def _plugin(claim: object) -> SimpleNamespace:
    """A plugin object whose kvspec_layer_spec hook is ``claim``."""
    return SimpleNamespace(
        kvspec_contract_version=CONTRACT_VERSION, kvspec_layer_spec=hookimpl(claim)
    )


def test_core_families_alone_plan_llama() -> None:
    manager = PluginManager()
    model = model_layers(preset("llama-3.1-8b"), PlanOptions(), manager, name="llama")
    specs = layer_specs(model, manager)
    assert list(specs) == [f"model.layers.{i}" for i in range(32)]
    assert all(type(spec) is FullAttentionSpec for spec in specs.values())


def test_a_missing_family_names_layer_type_and_distribution() -> None:
    manager = PluginManager()  # core only: no kvspec-mamba
    model = model_layers(preset("jamba-1.5-mini"), PlanOptions(), manager, name="jamba")
    with pytest.raises(MissingFamilyError) as caught:
        layer_specs(model, manager)
    message = str(caught.value)
    assert "layer model.layers.0" in message and "27 more layers" in message
    assert "'mamba'" in message and "pip install kvspec-mamba" in message


def test_an_unknown_third_party_type_says_which_plugin_is_needed() -> None:
    manager = PluginManager()
    config = {
        "num_hidden_layers": 1,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "layer_types": ["conv"],
    }
    model = model_layers(config, PlanOptions(), manager)
    with pytest.raises(MissingFamilyError, match=r"layer type 'conv'.*install the plugin"):
        layer_specs(model, manager)


def test_two_claims_name_both_plugins() -> None:
    manager = PluginManager()

    def greedy(layer: LayerConfig) -> KVSpec | None:
        assert layer.attention is not None
        return FullAttentionSpec(
            block_size=16, num_kv_heads=1, head_size=8, dtype=layer.attention.dtype
        )

    with registered(manager, _plugin(greedy), "greedy"):
        model = model_layers(preset("llama-3.1-8b"), PlanOptions(), manager)
        with pytest.raises(PluginError, match=r"claimed by several plugins: 'core' .*'greedy'"):
            layer_specs(model, manager)


def test_a_third_party_plugin_claims_a_passed_through_type() -> None:
    manager = PluginManager()
    seen: list[LayerConfig] = []

    def conv(layer: LayerConfig) -> KVSpec | None:
        if layer.layer_type != "conv":
            return None
        seen.append(layer)
        return FullAttentionSpec(
            block_size=layer.options.block_size,
            num_kv_heads=1,
            head_size=int(layer.config["conv_dim"]),
            dtype=layer.model_dtype,
        )

    config = {
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "conv_dim": 32,
        "layer_types": ["conv", "full_attention", "conv"],
    }
    with registered(manager, _plugin(conv), "conv"):
        specs = layer_specs(model_layers(config, PlanOptions(), manager), manager)
    assert [layer.index for layer in seen] == [0, 2]
    assert specs["model.layers.0"].head_size == 32
    assert specs["model.layers.1"].head_size == 16


def test_layer_config_is_read_only_for_plugins() -> None:
    model = model_layers(preset("llama-3.1-8b"), PlanOptions(), PluginManager())
    with pytest.raises(TypeError):
        model.layers[0].config["num_key_value_heads"] = 1  # type: ignore[index]


def test_an_all_mlp_pattern_is_refused() -> None:
    config = {
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "hybrid_override_pattern": "---",
    }
    with pytest.raises(ConfigError, match="no layer that holds a KV cache"):
        model_layers(config, PlanOptions(), PluginManager())


def test_default_context_takes_the_config_length_and_options() -> None:
    options = PlanOptions(tensor_parallel_size=16, decode_context_parallel_size=2)
    model = model_layers(preset("llama-3.1-8b"), options, PluginManager())
    ctx = default_sizing_context(model)
    assert (ctx.max_model_len, ctx.max_in_flight_tokens, ctx.dcp_size) == (131072, 16384, 2)
    assert ctx.prefix_caching and ctx.mamba_cache_mode == "none"
    assert default_sizing_context(model, max_model_len=4096).max_model_len == 4096


def test_state_models_use_align_mode_with_prefix_caching() -> None:
    for name in ("jamba-1.5-mini", "nemotron-h-56b", "qwen3-next-80b"):
        model = model_layers(preset(name), PlanOptions(), PluginManager())
        assert default_sizing_context(model).mamba_cache_mode == "align"
        assert default_sizing_context(model, prefix_caching=False).mamba_cache_mode == "none"


def test_whisper_context_holds_decoder_length_and_encoder_tokens() -> None:
    model = model_layers(preset("whisper-large-v3"), PlanOptions(), PluginManager())
    ctx = default_sizing_context(model)
    assert (ctx.max_model_len, ctx.max_encoder_tokens) == (448, 1500)


def test_a_config_without_a_length_needs_max_model_len() -> None:
    config = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4}
    model = model_layers(config, PlanOptions(), PluginManager())
    with pytest.raises(ConfigError, match="--max-model-len"):
        default_sizing_context(model)
    assert default_sizing_context(model, max_model_len=100).max_model_len == 100


def test_query_heads_of_a_kv_head_must_split_across_dcp() -> None:
    """40 query heads over 8 KV heads at TP 40: five ranks hold each KV head, but its five
    query heads do not split over DCP 2 (vLLM refuses it the same way)."""
    config = {
        "num_hidden_layers": 1,
        "hidden_size": 40 * 64,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
    }
    options = PlanOptions(tensor_parallel_size=40, decode_context_parallel_size=2)
    with pytest.raises(ConfigError, match="the 5 query heads of each KV head"):
        model_layers(config, options, PluginManager())
    accepted = PlanOptions(tensor_parallel_size=40, decode_context_parallel_size=5)
    assert model_layers(config, accepted, PluginManager()).layers


def test_kv_heads_that_do_not_divide_the_query_heads_are_refused() -> None:
    """Found in review: 5 KV heads over 32 query heads planned a cache no model has."""
    config = {
        "num_hidden_layers": 1,
        "hidden_size": 32 * 64,
        "num_attention_heads": 32,
        "num_key_value_heads": 5,
        "max_position_embeddings": 4096,
    }
    with pytest.raises(ConfigError, match="'num_key_value_heads'=5 does not divide"):
        model_layers(config, PlanOptions(), PluginManager())
