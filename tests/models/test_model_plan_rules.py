"""``plan_model`` plans only what the allocator built from the plan admits (found by review:
a kind sized below full attention without runtime rules of its own was planned by the
library, 21.33 requests, and refused by ``KVCacheAllocator.from_plan``; only ``kvspec
plan`` checked)."""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import pytest

from kvspec_core import (
    AttentionSpec,
    KVSpec,
    LayerConfig,
    PlanOptions,
    RegisterSpecKind,
    SizingContext,
    cdiv,
    hookimpl,
)
from kvspec_core.errors import RulesSizingError
from kvspec_core.models import load_preset, plan_model
from kvspec_core.models.planning import ModelPlan
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import KVCacheAllocator
from kvspec_core.testing import manager_with


@attrs.frozen(kw_only=True)
class HalfSpec(AttentionSpec):
    """Sized for half the blocks full attention holds, with no rules that free any."""

    kind: ClassVar[str] = "half_attention"

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return cdiv(cdiv(ctx.max_model_len, self.block_size), 2)


class HalfPlugin:
    kvspec_contract_version = 1

    @hookimpl
    def kvspec_register_spec_kinds(self, register: RegisterSpecKind) -> None:
        register(HalfSpec)

    @hookimpl
    def kvspec_layer_spec(self, layer: LayerConfig) -> KVSpec | None:
        if layer.layer_type != "half_attention":
            return None
        return HalfSpec(**layer.attention_spec_fields())


#: Llama-3.1-8B cut to two layers, the second of the toy kind.
CONFIG: dict[str, Any] = {
    **load_preset("llama-3.1-8b"),
    "num_hidden_layers": 2,
    "layer_types": ["full_attention", "half_attention"],
}


def plan(config: dict[str, Any], manager: PluginManager) -> ModelPlan:
    return plan_model(config, 8 << 30, PlanOptions(), manager, max_model_len=4096)


def test_a_kind_sized_below_its_rules_is_refused_by_plan_model() -> None:
    manager = manager_with(HalfPlugin(), "half")
    with pytest.raises(RulesSizingError, match="'half_attention' is sized for 128 blocks"):
        plan(CONFIG, manager)


def test_a_plan_model_accepts_is_one_the_allocator_takes() -> None:
    manager = manager_with(HalfPlugin(), "half")
    config = {**CONFIG, "layer_types": ["full_attention", "full_attention"]}
    result = plan(config, manager)
    KVCacheAllocator.from_plan(result.plan, manager=manager)
