"""One test per hook of the contract (a meta-test checks every hook has one)."""

from __future__ import annotations

import re
from typing import ClassVar

import attrs
import pytest
import torch

from kvspec_core import (
    AttentionShape,
    FullAttentionSpec,
    KVCacheDtype,
    KVQuantMode,
    KVSpec,
    LayerConfig,
    PlanOptions,
    PluginError,
    PluginManager,
    hookimpl,
)
from kvspec_core.testing import registered


@attrs.frozen(kw_only=True)
class ToySpec(FullAttentionSpec):
    kind: ClassVar[str] = "toy_attention"


class ToyRules:
    """Stands in for a FamilyRules factory: the registry only stores it."""

    def __init__(self, spec: KVSpec, ctx: object) -> None:
        self.spec = spec


class ToyPlugin:
    kvspec_contract_version = 1

    @hookimpl
    def kvspec_register_spec_kinds(self, register):
        register(ToySpec)

    @hookimpl
    def kvspec_register_kv_dtypes(self, register):
        register(
            KVCacheDtype(
                name="int2_toy",
                storage_dtype=torch.uint8,
                quant_mode=KVQuantMode(name="int2_toy", key_bits=2, value_bits=2),
            )
        )

    @hookimpl
    def kvspec_register_runtime_rules(self, register):
        register("toy_attention", ToyRules)

    @hookimpl
    def kvspec_layer_spec(self, layer: LayerConfig) -> KVSpec | None:
        if layer.layer_type != "toy":
            return None
        return ToySpec(
            block_size=layer.options.block_size,
            num_kv_heads=1,
            head_size=8,
            dtype=layer.model_dtype,
        )


def layer(layer_type: str) -> LayerConfig:
    return LayerConfig(
        index=0,
        name="model.layers.0",
        layer_type=layer_type,
        config={},
        options=PlanOptions(),
        model_dtype=torch.float16,
        attention=AttentionShape(
            num_kv_heads=2, total_kv_heads=2, head_size=64, head_size_v=64, dtype=torch.float16
        ),
    )


def test_hook_kvspec_register_spec_kinds() -> None:
    manager = PluginManager()
    with registered(manager, ToyPlugin(), "toy") as info:
        assert info.spec_kinds == ("toy_attention",)
        assert manager.spec_kinds.class_of("toy_attention") is ToySpec
        assert manager.spec_kinds.uniform_base_of(ToySpec) is FullAttentionSpec
    assert "toy_attention" not in manager.spec_kinds


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (int, "not a KVSpec subclass"),
        (type("NoAttrs", (FullAttentionSpec,), {"kind": "x"}), "not an attrs class"),
    ],
)
def test_hook_kvspec_register_spec_kinds_refuses_bad_classes(bad, message) -> None:
    class Bad:
        kvspec_contract_version = 1

        @hookimpl
        def kvspec_register_spec_kinds(self, register):
            register(bad)

    manager = PluginManager()
    with pytest.raises(PluginError, match=f"plugin 'bad'.*{message}"):
        manager.register(Bad(), "bad")
    assert not manager.is_loaded("bad")


def test_hook_kvspec_register_kv_dtypes() -> None:
    manager = PluginManager()
    with registered(manager, ToyPlugin(), "toy"):
        assert manager.kv_dtypes.get("int2_toy").quant_mode.key_bits == 2
        assert manager.kv_dtypes.owner_of("int2_toy") == "toy"


def test_hook_kvspec_register_runtime_rules() -> None:
    manager = PluginManager()
    with registered(manager, ToyPlugin(), "toy"):
        assert manager.runtime_rules("toy_attention") is ToyRules
    assert manager.runtime_rules("toy_attention") is None

    class Poacher:
        kvspec_contract_version = 1

        @hookimpl
        def kvspec_register_runtime_rules(self, register):
            register("full_attention", "mine")

    with pytest.raises(PluginError, match="kind 'full_attention', which plugin 'core' owns"):
        manager.register(Poacher(), "poacher")

    class NotAFactory:
        kvspec_contract_version = 1

        @hookimpl
        def kvspec_register_spec_kinds(self, register):
            register(ToySpec)

        @hookimpl
        def kvspec_register_runtime_rules(self, register):
            register("toy_attention", "toy-rules")

    with pytest.raises(PluginError, match="must be a factory rules\\(spec, ctx\\)"):
        manager.register(NotAFactory(), "not_a_factory")
    assert "toy_attention" not in manager.spec_kinds


def test_hook_kvspec_layer_spec() -> None:
    manager = PluginManager()
    with registered(manager, ToyPlugin(), "toy"):
        [(owner, spec)] = manager.layer_specs(layer("toy"))
        assert owner == "toy" and isinstance(spec, ToySpec)
        [(owner, spec)] = manager.layer_specs(layer("full_attention"))
        assert owner == "core" and spec == FullAttentionSpec(
            block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16, max_tp_shards=2
        )
    assert manager.layer_specs(layer("toy")) == []


def test_hook_kvspec_layer_spec_faults_name_the_plugin() -> None:
    class Raising:
        kvspec_contract_version = 1

        @hookimpl
        def kvspec_layer_spec(self, layer):
            raise KeyError("hidden_size")

    class Confused:
        kvspec_contract_version = 1

        @hookimpl
        def kvspec_layer_spec(self, layer):
            return "a spec, honest"

    # A layer no other plugin claims: the fault is the answer (tests/plugin_system/
    # test_layer_hook_isolation.py covers layers another plugin claims).
    manager = PluginManager()
    with (
        registered(manager, Raising(), "raising"),
        pytest.raises(
            PluginError,
            match=re.escape(
                "plugin 'raising' raised KeyError in kvspec_layer_spec for layer model.layers.0"
            ),
        ),
    ):
        manager.layer_specs(layer("unclaimed_attention"))
    with (
        registered(manager, Confused(), "confused"),
        pytest.raises(PluginError, match="'confused' returned 'a spec, honest'"),
    ):
        manager.layer_specs(layer("unclaimed_attention"))


def test_hook_kvspec_layer_spec_core_sinks() -> None:
    manager = PluginManager()
    sink = attrs.evolve(layer("full_attention"), config={"attention_sink_len": 4})
    [(_, spec)] = manager.layer_specs(sink)
    assert spec.kind == "sink_full_attention" and spec.sink_len == 4
    from kvspec_core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.layers.0.*'attention_sink_len'='four'"):
        manager.layer_specs(
            attrs.evolve(layer("full_attention"), config={"attention_sink_len": "four"})
        )
