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


#: method -> what it answers when ``FaultySpec.answers`` names it (a bad answer, no raise).
BAD_ANSWERS: dict[str, object] = {
    "state_content_size_bytes": 0,
    "page_size_bytes": "4096",
    "num_heads": True,
    "max_blocks_per_request": -3,
    "host_resident": 1,
    "view_dtype": "bfloat16",
    "merge": "not a spec",
}


@attrs.frozen(kw_only=True)
class FaultySpec(FullAttentionSpec):
    """Full attention whose method ``broken`` raises (when ``broken`` names one) and whose
    method ``answers`` returns its bad answer from :data:`BAD_ANSWERS`."""

    kind: ClassVar[str] = "faulty_attention"
    broken: str = ""
    answers: str = ""

    @property
    def page_size_bytes(self) -> Any:
        if self.broken == "page_size_bytes":
            raise PluginBug("page size went missing")
        return self._answer("page_size_bytes", super().page_size_bytes)

    @property
    def state_content_size_bytes(self) -> Any:
        return self._answer("state_content_size_bytes", super().state_content_size_bytes)

    @property
    def num_heads(self) -> Any:
        return self._answer("num_heads", super().num_heads)

    @property
    def view_dtype(self) -> Any:
        return self._answer("view_dtype", super().view_dtype)

    @property
    def host_resident(self) -> Any:
        return self._answer("host_resident", super().host_resident)

    def max_blocks_per_request(self, ctx: SizingContext) -> Any:
        if self.broken == "max_blocks_per_request":
            raise PluginBug("no idea how many blocks")
        return self._answer("max_blocks_per_request", super().max_blocks_per_request(ctx))

    @classmethod
    def merge(cls, specs: Sequence[Any], layer_names: Sequence[str] = ()) -> Any:
        if specs and specs[0].broken == "merge":
            raise PluginBug("cannot merge")
        if specs and specs[0].answers == "merge":
            return BAD_ANSWERS["merge"]
        return super().merge(specs, layer_names)

    def is_uniform_with(self, specs: Any, registry: Any) -> Any:
        if self.answers == "is_uniform_with":
            return "no"
        return super().is_uniform_with(specs, registry)

    def _answer(self, method: str, sound: object) -> Any:
        return BAD_ANSWERS[method] if self.answers == method else sound


class FaultyPlugin:
    kvspec_contract_version = 1

    @hookimpl
    def kvspec_register_spec_kinds(self, register) -> None:  # type: ignore[no-untyped-def]
        register(FaultySpec)


def manager_with_faulty_plugin() -> PluginManager:
    manager = PluginManager()
    manager.register(FaultyPlugin(), "faulty", distribution="kvspec-faulty", version="0.1")
    return manager


def faulty_layers(broken: str = "", answers: str = "") -> dict[str, FaultySpec]:
    return {
        f"model.layers.{i}": FaultySpec(
            block_size=16,
            num_kv_heads=2,
            head_size=64,
            dtype=torch.bfloat16,
            broken=broken,
            answers=answers,
        )
        for i in range(3)
    }


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
    with pytest.raises(PluginError, match=r"plugin 'faulty'.*FaultySpec\.max_blocks_per_request"):
        largest_fitting_max_model_len(
            faulty_layers("max_blocks_per_request"), 64 << 20, CTX, manager_with_faulty_plugin()
        )


def test_kvspec_errors_and_sound_specs_are_untouched() -> None:
    manager = manager_with_faulty_plugin()
    plan = plan_kv_cache(faulty_layers(""), 64 << 20, CTX, manager)
    assert plan.groups[0].kind == "faulty_attention"
    with pytest.raises(CapacityError):
        plan_kv_cache(faulty_layers(""), 1 << 10, CTX, manager)


@pytest.mark.parametrize("method", sorted(BAD_ANSWERS))
def test_a_bad_answer_is_a_plugin_error_naming_plugin_method_value_and_layer(method: str) -> None:
    """0 bytes used to divide by zero in the budget split, a str failed in the geometry with a
    TypeError, and a negative admission cap planned more requests than fit."""
    with pytest.raises(PluginError) as raised:
        plan_kv_cache(faulty_layers(answers=method), 64 << 20, CTX, manager_with_faulty_plugin())
    message = str(raised.value)
    assert message.startswith(
        "plugin 'faulty' (distribution kvspec-faulty): "
        f"FaultySpec.{method} of spec kind 'faulty_attention' returned "
        f"{BAD_ANSWERS[method]!r}"
    )
    assert "model.layers.0" in message and "but it must be" in message
    assert "KVSPEC_PLUGINS" in message


def test_a_negative_admission_cap_is_refused_in_the_length_search_too() -> None:
    with pytest.raises(PluginError, match=r"FaultySpec\.max_blocks_per_request .* returned -3"):
        largest_fitting_max_model_len(
            faulty_layers(answers="max_blocks_per_request"),
            64 << 20,
            CTX,
            manager_with_faulty_plugin(),
        )


def test_a_uniformity_answer_that_is_no_bool_is_refused() -> None:
    """Layers that do not merge (other head counts) ask the first spec whether they can share
    a uniform-type group; the truthy "no" used to put them in one."""
    specs = {
        f"model.layers.{i}": FaultySpec(
            block_size=16,
            num_kv_heads=2 + i,
            head_size=64,
            dtype=torch.bfloat16,
            answers="is_uniform_with",
        )
        for i in range(3)
    }
    with pytest.raises(
        PluginError,
        match=r"plugin 'faulty' \(distribution kvspec-faulty\): "
        r"FaultySpec\.is_uniform_with .* returned 'no'",
    ):
        plan_kv_cache(specs, 64 << 20, CTX, manager_with_faulty_plugin())
