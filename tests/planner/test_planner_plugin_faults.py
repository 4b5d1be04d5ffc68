"""A plugin's spec method that raises while a plan is built becomes a PluginError naming the
plugin, its distribution, the spec kind and the method (kvspec's own errors pass as they are)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import attrs
import pytest
import torch

from kvspec_core import FullAttentionSpec, PluginManager, SizingContext, hookimpl
from kvspec_core.errors import CapacityError, PluginError
from kvspec_core.planner import largest_fitting_max_model_len, plan_kv_cache

CTX = SizingContext(max_model_len=1024)


class PluginBug(Exception):
    """What a buggy plugin raises."""


@attrs.frozen(kw_only=True)
class FaultySpec(FullAttentionSpec):
    """Full attention whose method ``broken`` raises (when ``broken`` names one)."""

    kind: ClassVar[str] = "faulty_attention"
    broken: str = ""

    @property
    def page_size_bytes(self) -> int:
        if self.broken == "page_size_bytes":
            raise PluginBug("page size went missing")
        return super().page_size_bytes

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        if self.broken == "max_blocks_per_request":
            raise PluginBug("no idea how many blocks")
        return super().max_blocks_per_request(ctx)

    @classmethod
    def merge(cls, specs: Sequence[Any], layer_names: Sequence[str] = ()) -> Any:
        if specs and specs[0].broken == "merge":
            raise PluginBug("cannot merge")
        return super().merge(specs, layer_names)


class FaultyPlugin:
    kvspec_contract_version = 1

    @hookimpl
    def kvspec_register_spec_kinds(self, register) -> None:  # type: ignore[no-untyped-def]
        register(FaultySpec)


def manager_with_faulty_plugin() -> PluginManager:
    manager = PluginManager()
    manager.register(FaultyPlugin(), "faulty", distribution="kvspec-faulty", version="0.1")
    return manager


def faulty_layers(broken: str) -> dict[str, FaultySpec]:
    return {f"model.layers.{i}": FaultySpec(block_size=16, num_kv_heads=2, head_size=64,
                                            dtype=torch.bfloat16, broken=broken)
            for i in range(3)}


@pytest.mark.parametrize("method", ["page_size_bytes", "max_blocks_per_request", "merge"])
def test_a_raising_spec_method_is_a_plugin_error_naming_all(method: str) -> None:
    manager = manager_with_faulty_plugin()
    with pytest.raises(PluginError) as raised:
        plan_kv_cache(faulty_layers(method), 64 << 20, CTX, manager)
    message = str(raised.value)
    assert "plugin 'faulty' (distribution kvspec-faulty)" in message
    assert f"FaultySpec.{method}" in message and "'faulty_attention'" in message
    assert "PluginBug" in message
    assert isinstance(raised.value.__cause__, PluginBug)


def test_the_fitting_length_search_names_the_plugin_too() -> None:
    with pytest.raises(PluginError, match="plugin 'faulty'.*FaultySpec.max_blocks_per_request"):
        largest_fitting_max_model_len(faulty_layers("max_blocks_per_request"), 64 << 20, CTX,
                                      manager_with_faulty_plugin())


def test_kvspec_errors_and_sound_specs_are_untouched() -> None:
    manager = manager_with_faulty_plugin()
    plan = plan_kv_cache(faulty_layers(""), 64 << 20, CTX, manager)
    assert plan.groups[0].kind == "faulty_attention"
    with pytest.raises(CapacityError):
        plan_kv_cache(faulty_layers(""), 1 << 10, CTX, manager)
