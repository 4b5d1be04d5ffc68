"""Plugin faults (repeated or failed registrations, pluggy pitfalls, stray specs) are refused
naming the plugin, and never damage what other plugins registered."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import pytest
import torch

from kvspec_core import (
    FullAttentionSpec,
    KVCacheDtype,
    KVSpec,
    LayerConfig,
    PlanOptions,
    PluginError,
    PluginManager,
    hookimpl,
)
from kvspec_core.kv_dtypes import BUILTIN_KV_CACHE_DTYPES
from kvspec_core.testing import registered


def plugin(name: str, **hooks: Callable[..., Any]) -> types.ModuleType:
    module = types.ModuleType(name)
    module.kvspec_contract_version = 1  # type: ignore[attr-defined]
    for hook_name, function in hooks.items():
        setattr(module, hook_name, hookimpl(function))
    return module


def test_same_plugin_object_under_a_second_name_leaves_the_first_intact() -> None:
    pm = PluginManager()

    def register_dtypes(register: Any) -> None:
        register(KVCacheDtype(name="x_toy", storage_dtype=torch.int8))

    module = plugin("a", kvspec_register_kv_dtypes=register_dtypes)
    pm.register(module, "a")
    with pytest.raises(PluginError, match=r"'b'.*already registered as 'a'"):
        pm.register(module, "b")
    assert pm.is_loaded("a") and not pm.is_loaded("b")
    assert pm.kv_dtypes.owner_of("x_toy") == "a"
    pm.unregister("a")  # still fully registered, so it can be removed cleanly
    assert "x_toy" not in pm.kv_dtypes.names()


def test_reregistering_another_plugins_kind_is_refused_and_keeps_the_owner() -> None:
    pm = PluginManager()

    def register_kinds(register: Any) -> None:
        register(FullAttentionSpec)

    with pytest.raises(PluginError, match=r"'full_attention'.*already registered by plugin 'core'"):
        pm.register(plugin("thief", kvspec_register_spec_kinds=register_kinds), "thief")
    assert pm.spec_kinds.owner_of("full_attention") == "core"
    assert not pm.is_loaded("thief")


def test_failed_plugin_that_repeated_a_core_dtype_does_not_remove_it() -> None:
    pm = PluginManager()
    fp8 = next(d for d in BUILTIN_KV_CACHE_DTYPES if d.name == "fp8")

    def register_dtypes(register: Any) -> None:
        register(fp8)
        raise RuntimeError("boom")

    with pytest.raises(PluginError, match="'d' raised RuntimeError"):
        pm.register(plugin("d", kvspec_register_kv_dtypes=register_dtypes), "d")
    assert pm.kv_dtypes.get("fp8") == fp8
    assert pm.kv_dtypes.owner_of("fp8") == "core"
    assert pm.kv_dtypes.owner_of("fp8_e4m3") == "core"


def test_hookimpl_argument_with_a_default_is_refused() -> None:
    # pluggy never passes an argument that has a default, so the hook would silently see it.
    pm = PluginManager()

    def kvspec_layer_spec(layer: Any = None) -> None:
        return None

    with pytest.raises(PluginError, match=r"'e'.*kvspec_layer_spec.*'layer'.*default"):
        pm.register(plugin("e", kvspec_layer_spec=kvspec_layer_spec), "e")
    assert not pm.is_loaded("e")
    assert pm._pm.get_plugin("e") is None


@pytest.mark.parametrize("marker", [{"wrapper": True}, {"hookwrapper": True}])
def test_wrapper_hookimpls_are_refused(marker: dict[str, bool]) -> None:
    # The core calls each implementation itself; a wrapper would only return a generator.
    pm = PluginManager()
    module = types.ModuleType("w")
    module.kvspec_contract_version = 1  # type: ignore[attr-defined]

    def kvspec_register_kv_dtypes(register: Any) -> Any:
        yield

    module.kvspec_register_kv_dtypes = hookimpl(**marker)(  # type: ignore[attr-defined]
        kvspec_register_kv_dtypes
    )
    with pytest.raises(PluginError, match=r"'w'.*kvspec_register_kv_dtypes.*wrapper"):
        pm.register(module, "w")
    assert not pm.is_loaded("w")
    assert pm._pm.get_plugin("w") is None


@pytest.mark.parametrize("declared", [True, 1.0, "1"])
def test_contract_version_must_be_the_int(declared: object) -> None:
    pm = PluginManager()
    module = plugin("v")
    module.kvspec_contract_version = declared  # type: ignore[attr-defined]
    with pytest.raises(PluginError, match=r"'v'.*contract version"):
        pm.register(module, "v")
    assert not pm.is_loaded("v")


def test_layer_spec_of_an_unregistered_kind_names_the_plugin() -> None:
    @attrs.frozen(kw_only=True)
    class Stray(KVSpec):
        kind: ClassVar[str] = "stray_kind"

    class Unregistered:
        kvspec_contract_version = 1

        @hookimpl
        def kvspec_layer_spec(self, layer: Any) -> KVSpec:
            return Stray(block_size=16)

    manager = PluginManager()
    probe = LayerConfig(
        index=0,
        name="model.layers.0",
        layer_type="x",
        config={},
        options=PlanOptions(),
        model_dtype=torch.float16,
    )
    with (
        registered(manager, Unregistered(), "stray"),
        pytest.raises(
            PluginError,
            match=r"plugin 'stray' returned a Stray for layer "
            r"model.layers.0.*not a registered spec kind",
        ),
    ):
        manager.layer_specs(probe)


@attrs.frozen(kw_only=True)
class _TypoMergeSpec(FullAttentionSpec):
    kind: ClassVar[str] = "typo_merge"
    # "non_casual" is no field: the generic merge would silently compare non_causal exactly.
    merge_any_fields: ClassVar[frozenset[str]] = frozenset({"non_casual"})


@attrs.frozen(kw_only=True)
class _BothRulesSpec(FullAttentionSpec):
    kind: ClassVar[str] = "both_rules"
    merge_optional_fields: ClassVar[frozenset[str]] = frozenset({"sliding_window", "non_causal"})


@pytest.mark.parametrize(
    ("spec_class", "message"),
    [
        (_TypoMergeSpec, r"merge_any_fields names \['non_casual'\], which are not fields"),
        (_BothRulesSpec, r"\['non_causal'\] in both merge_any_fields and merge_optional_fields"),
    ],
)
def test_merge_field_declarations_must_name_fields(spec_class: type, message: str) -> None:
    def register_kinds(register: Any) -> None:
        register(spec_class)

    pm = PluginManager()
    with pytest.raises(PluginError, match=f"'typo'.*{spec_class.__name__}.*{message}"):
        pm.register(plugin("typo", kvspec_register_spec_kinds=register_kinds), "typo")
    assert spec_class.kind not in pm.spec_kinds


def test_a_plugin_raising_on_attribute_access_is_refused_as_a_plugin_error() -> None:
    # An entry point may load any object; its attribute access must not escape as a bare
    # exception, which would abort loading the plugins after it.
    module = types.ModuleType("hostile")

    def module_getattr(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"no {name} here")

    module.__getattr__ = module_getattr  # type: ignore[attr-defined]
    pm = PluginManager()
    with pytest.raises(PluginError, match=r"'hostile'.*RuntimeError.*kvspec_contract_version"):
        pm.register(module, "hostile")
    assert not pm.is_loaded("hostile") and pm._pm.get_plugin("hostile") is None


@attrs.frozen(kw_only=True)
class _InstanceMergeSpec(FullAttentionSpec):
    """``merge`` written as an instance method: the planner calls it on the class, where the
    list of specs would become ``self``."""

    kind: ClassVar[str] = "instance_merge_test"

    def merge(self, specs, layer_names=()):  # type: ignore[no-untyped-def, override]
        return self


def test_a_merge_that_is_not_a_classmethod_is_refused_at_registration() -> None:
    """It used to register and then fail planning with a TypeError naming no plugin."""
    pm = PluginManager()

    def register_kinds(register: Any) -> None:
        register(_InstanceMergeSpec)

    with pytest.raises(
        PluginError,
        match=r"plugin 'merger' .distribution kvspec-merger.: .*"
        r"_InstanceMergeSpec, whose merge .* is not a "
        r"classmethod; declare it as @classmethod",
    ):
        pm.register(
            plugin("merger", kvspec_register_spec_kinds=register_kinds),
            "merger",
            distribution="kvspec-merger",
        )
    assert not pm.is_loaded("merger") and "instance_merge_test" not in pm.spec_kinds.kinds()
