"""Gemma-3n's cross-layer KV sharing, read from its config and checked against the tensors
transformers' own model hands each attention layer; the plan holds no blocks for the readers.

The configs are transformers 5's ``Gemma3nTextConfig`` (its defaults are Gemma-3n-E4B's
text model, per its docstring: 35 layers, every fifth full attention, the last 15 sharing,
2 KV heads of 256, window 512, 32,768 positions), shrunk where a model is run."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core.errors import ConfigError
from kvspec_core.models.kv_sharing import kv_sharing_sources
from kvspec_core.models.layer_typing import LayerSlot
from kvspec_core.models.planning import plan_model, prepare_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs import KVSharingSpec

transformers = pytest.importorskip("transformers")
gemma3n = pytest.importorskip("transformers.models.gemma3n.modeling_gemma3n")

TINY = dict(
    vocab_size=128,
    vocab_size_per_layer_input=128,
    hidden_size=32,
    hidden_size_per_layer_input=8,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    laurel_rank=4,
    max_position_embeddings=64,
    sliding_window=8,
)
#: transformers' default Gemma3nTextConfig (E4B's text model), read while transformers is here.
E4B = transformers.Gemma3nTextConfig().to_dict()


def _readers_in_model_code(config: transformers.Gemma3nTextConfig) -> dict[int, int]:
    """Reader layer index -> the layer whose key tensor it attends over, seen by running
    transformers' Gemma-3n on random weights and recording every attention call."""
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    model = transformers.Gemma3nTextModel(config).eval()
    keys: dict[int, torch.Tensor] = {}
    real = gemma3n.eager_attention_forward

    def recording(module, query, key, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        keys[module.layer_idx] = key
        return real(module, query, key, value, *args, **kwargs)

    gemma3n.eager_attention_forward = recording
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(0, 128, (1, 12)), use_cache=False)
    finally:
        gemma3n.eager_attention_forward = real
    assert sorted(keys) == list(range(config.num_hidden_layers))
    # A layer computing its own keys is the first to attend over that tensor object.
    owners = {
        index: min(other for other, seen in keys.items() if seen is key)
        for index, key in keys.items()
    }
    return {index: owner for index, owner in owners.items() if owner != index}


def _kvspec_readers(config: transformers.Gemma3nTextConfig, manager: PluginManager):
    prepared = prepare_model(config.to_dict(), PlanOptions(), manager, name="gemma3n")
    return prepared, {
        int(reader.rsplit(".", 1)[1]): int(source.rsplit(".", 1)[1])
        for reader, source in prepared.model.kv_sharing.items()
    }


@pytest.mark.parametrize(
    ("layers", "shared", "layer_types"),
    [
        (10, 4, None),  # transformers' own pattern: every fifth layer full attention
        (
            7,
            3,
            ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
            + ["sliding_attention"] * 2
            + ["full_attention"],
        ),
        (6, 2, ["full_attention", "sliding_attention"] * 3),
    ],
)
def test_readers_match_the_tensors_transformers_hands_each_layer(
    layers: int, shared: int, layer_types: list[str] | None, kvspec_loaded_manager: PluginManager
) -> None:
    config = transformers.Gemma3nTextConfig(
        num_hidden_layers=layers,
        num_kv_shared_layers=shared,
        layer_types=layer_types,
        **TINY,
    )
    expected = _readers_in_model_code(config)
    assert len(expected) == shared  # the last `shared` layers read another's keys
    prepared, readers = _kvspec_readers(config, kvspec_loaded_manager)
    assert readers == expected
    for index, source in expected.items():
        spec = prepared.specs[f"model.layers.{index}"]
        assert isinstance(spec, KVSharingSpec) and spec.target_layer == f"model.layers.{source}"
        assert spec.reader_spec == prepared.specs[f"model.layers.{source}"]


def _slots(types: list[str]) -> list[LayerSlot]:
    return [
        LayerSlot(index=index, name=f"model.layers.{index}", layer_type=kind)
        for index, kind in enumerate(types)
    ]


def _modes_to_readers(config: transformers.Gemma3nTextConfig) -> dict[int, int]:
    """transformers' ``kv_sharing_modes`` as its attention forward reads it: a "reuse"
    layer reads ``shared_kv_states[layer_type]``, written by the "store" layer of its type."""
    modes = config.kv_sharing_modes
    stores = {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    return {i: stores[config.layer_types[i]] for i, mode in enumerate(modes) if mode == "reuse"}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_pattern_matches_transformers_sharing_modes(data: st.DataObject) -> None:
    layers = data.draw(st.integers(2, 24))
    types = data.draw(
        st.lists(
            st.sampled_from(["sliding_attention", "full_attention"]),
            min_size=layers,
            max_size=layers,
        )
    )
    shared = data.draw(st.integers(0, layers - 1))
    config = transformers.Gemma3nTextConfig(
        num_hidden_layers=layers, num_kv_shared_layers=shared, layer_types=types, **TINY
    )
    slots = _slots(types)
    fields = {"model_type": "gemma3n_text", "num_kv_shared_layers": shared}
    try:
        expected = _modes_to_readers(config)
    except ValueError:
        # transformers refuses a reader type with no earlier layer of that type; so do we.
        with pytest.raises(ConfigError, match="no layer before layer"):
            kv_sharing_sources(fields, slots, layers)
        return
    found = kv_sharing_sources(fields, slots, layers)
    assert {int(r.rsplit(".", 1)[1]): int(s.rsplit(".", 1)[1]) for r, s in found.items()} == (
        expected
    )


def test_e4b_plans_only_the_layers_holding_a_cache(kvspec_loaded_manager: PluginManager) -> None:
    """transformers' default Gemma3nTextConfig (E4B): 20 layers hold a cache (16 sliding,
    4 full), the last 15 read layer 18 (sliding) or 19 (full). At 40 GiB, block 16,
    32,768 tokens, 16,384 in flight: a page is 16 x 2 heads x (256 + 256) x 2 B = 32 KiB,
    five groups of 4 share one pool of 128 KiB blocks; a request holds
    4 x 4 x (cdiv(511 + 16,384, 16) + 1) + 4 x 2,048 blocks of the 4 slots' groups."""
    result = plan_model(
        {"model_type": "gemma3n_text"}, 40 << 30, PlanOptions(), kvspec_loaded_manager
    )
    plan = result.plan
    assert plan.memoryless_layers == tuple(f"model.layers.{i}" for i in range(20, 35))
    assert dict(plan.kv_sharing) == {
        f"model.layers.{i}": "model.layers.19" if i % 5 == 4 else "model.layers.18"
        for i in range(20, 35)
    }
    assert sorted(len(group.layers) for group in plan.groups) == [4] * 5
    (pool,) = plan.pools
    assert pool.block_bytes == 4 * 16 * 2 * 512 * 2
    assert pool.blocks_per_request == 4 * 1057 + 2048
    assert pool.num_blocks == (40 << 30) // pool.block_bytes == 327_680
    assert plan.max_concurrency == pytest.approx((327_680 - 1) / 6276)
    assert round(plan.max_concurrency, 2) == 52.21


def test_the_nested_multimodal_config_shares_too(kvspec_loaded_manager: PluginManager) -> None:
    config = transformers.Gemma3nConfig().to_dict()
    prepared = prepare_model(config, PlanOptions(), kvspec_loaded_manager, name="gemma-3n")
    assert len(prepared.model.kv_sharing) == 15


@pytest.mark.parametrize("value", [-1, 35, 40, 1.5, "15"])
def test_a_bad_shared_layer_count_is_refused_naming_the_field(value: object) -> None:
    slots = _slots(["full_attention"] * 35)
    with pytest.raises(ConfigError, match="'num_kv_shared_layers' is") as caught:
        kv_sharing_sources({"model_type": "gemma3n_text", "num_kv_shared_layers": value}, slots, 35)
    assert "at least one layer must hold a cache" in str(caught.value)


def test_sharing_kvspec_cannot_read_is_refused() -> None:
    slots = _slots(["full_attention"] * 4)
    with pytest.raises(ConfigError) as caught:
        kv_sharing_sources({"model_type": "gemma4_text", "num_kv_shared_layers": 2}, slots, 4)
    message = str(caught.value)
    assert "model_type 'gemma4_text'" in message and "'num_kv_shared_layers'=2" in message
    assert "reads only for model types gemma3n_text" in message and "Set it to 0" in message
    with pytest.raises(ConfigError, match="'kv_source_layers'"):
        kv_sharing_sources(
            {"model_type": "mistral_large4_text", "kv_source_layers": [0, 0, 2, 2]}, slots, 4
        )
    # Declaring no sharing is fine for any model type.
    assert kv_sharing_sources({"model_type": "x", "num_kv_shared_layers": 0}, slots, 4) == {}
    assert kv_sharing_sources({"model_type": "x", "kv_source_layers": [0, 1, 2, 3]}, slots, 4) == {}


def test_the_model_code_check_sees_which_layers_read_a_shared_cache(
    kvspec_loaded_manager: PluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers marks a layer computing no K/V (``is_kv_shared_layer``); were kvspec to
    miss the sharing, the check against the model code refuses instead of planning 15 caches
    too many."""
    import kvspec_core.models.ingest as ingest

    config = transformers.Gemma3nTextConfig(num_hidden_layers=10, num_kv_shared_layers=4, **TINY)
    prepare_model(config.to_dict(), PlanOptions(), kvspec_loaded_manager, name="gemma3n")
    monkeypatch.setattr(ingest, "kv_sharing_sources", lambda *args, **kwargs: {})
    with pytest.raises(ConfigError) as caught:
        prepare_model(config.to_dict(), PlanOptions(), kvspec_loaded_manager, name="gemma3n")
    message = str(caught.value)
    assert "disagrees with transformers' Gemma3nForCausalLM at layer 6" in message
    assert "sliding_attention (window 8), reading an earlier layer's cache" in message


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.usefixtures("without_transformers")
def test_without_transformers_a_config_omitting_the_count_takes_its_default(
    nested: bool, kvspec_loaded_manager: PluginManager
) -> None:
    """Gemma3nTextConfig's default ``num_kv_shared_layers`` is 15: a hand-written E4B config
    leaving it out shares as transformers builds it, not a cache per layer (35 caches would
    overstate the memory 35/20-fold without any error)."""
    text = {key: value for key, value in E4B.items() if key != "num_kv_shared_layers"}
    config = {"model_type": "gemma3n", "text_config": text} if nested else text
    prepared = prepare_model(config, PlanOptions(), kvspec_loaded_manager, name="gemma-3n")
    assert "num_kv_shared_layers" in prepared.model.source.filled_fields
    assert len(prepared.model.kv_sharing) == 15
    assert prepared.model.kv_sharing["model.layers.24"] == "model.layers.19"
