"""A plugin can be written against the public names alone: ``kvspec_core`` and
``kvspec_core.plugins`` export the whole contract (layer view, registration callables,
runtime rules, sizing arithmetic), and nothing they export lives in a private module."""

from __future__ import annotations

from typing import ClassVar

import attrs
import pytest

import kvspec_core
import kvspec_core.plugins
from kvspec_core import (
    AttentionSpec,
    FamilyRules,
    KVSpec,
    LayerConfig,
    RegisterRuntimeRules,
    RegisterSpecKind,
    SizingContext,
    cdiv,
    hookimpl,
)
from kvspec_core.runtime import TrailingWindowRules, rules_for
from kvspec_core.testing import manager_with, model_layer

CONTRACT_NAMES = [
    "LayerConfig",
    "AttentionShape",
    "PlanOptions",
    "RegisterSpecKind",
    "RegisterKVDtype",
    "RegisterRuntimeRules",
]


@pytest.mark.parametrize("package", [kvspec_core, kvspec_core.plugins], ids=lambda p: p.__name__)
def test_every_export_resolves_to_a_public_module(package: object) -> None:
    for name in package.__all__:  # type: ignore[attr-defined]
        value = getattr(package, name)
        module = getattr(value, "__module__", None) or ""
        if not module.startswith("kvspec_core"):
            continue  # e.g. pluggy's marker instance
        assert not any(part.startswith("_") for part in module.split(".")), (name, module)


def test_plugins_package_and_root_export_the_same_contract_objects() -> None:
    for name in CONTRACT_NAMES:
        assert getattr(kvspec_core, name) is getattr(kvspec_core.plugins, name)
    assert kvspec_core.FamilyRules is kvspec_core.runtime.FamilyRules


@attrs.frozen(kw_only=True)
class EveryOtherBlockSpec(AttentionSpec):
    """A toy family: keeps half of the blocks a full-attention layer would."""

    kind: ClassVar[str] = "every_other_block_attention"

    def max_blocks_per_request(self, ctx: SizingContext) -> int:
        return cdiv(cdiv(ctx.max_model_len, self.block_size), 2)


class EveryOtherBlockRules(TrailingWindowRules):
    """Frees what the spec's sizing leaves out (rules that free nothing are refused for it):
    keeps the last half of max_model_len's positions."""

    hit_priority = 3

    def __init__(self, spec: KVSpec, ctx: SizingContext) -> None:
        super().__init__(spec, ctx)
        self.retained_tokens = ctx.max_model_len // 2


class PublicNamesPlugin:
    kvspec_contract_version = kvspec_core.CONTRACT_VERSION

    @hookimpl
    def kvspec_register_spec_kinds(self, register: RegisterSpecKind) -> None:
        register(EveryOtherBlockSpec)

    @hookimpl
    def kvspec_register_runtime_rules(self, register: RegisterRuntimeRules) -> None:
        register(EveryOtherBlockSpec.kind, EveryOtherBlockRules)

    @hookimpl
    def kvspec_layer_spec(self, layer: LayerConfig) -> KVSpec | None:
        if layer.layer_type != "every_other":
            return None
        return EveryOtherBlockSpec(**layer.attention_spec_fields())


def test_a_plugin_written_against_public_names_claims_layers_and_runs() -> None:
    manager = manager_with(PublicNamesPlugin(), "public-names")
    config = {
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "hidden_size": 512,
        "torch_dtype": "bfloat16",
        "layer_types": ["full_attention", "every_other"],
    }
    layer = model_layer(config, 1, manager)
    [(owner, spec)] = manager.layer_specs(layer)
    assert owner == "public-names" and isinstance(spec, EveryOtherBlockSpec)
    assert (spec.block_size, spec.num_kv_heads, spec.head_size) == (16, 2, 64)
    ctx = SizingContext(max_model_len=1024)
    assert spec.max_blocks_per_request(ctx) == 32
    rules = rules_for(spec, ctx, manager)
    assert isinstance(rules, EveryOtherBlockRules) and isinstance(rules, FamilyRules)


def test_importing_the_root_loads_the_runtime_as_it_always_did() -> None:
    # In a fresh interpreter: `import kvspec_core` alone makes `kvspec_core.runtime` usable
    # (it did before the plugin contract moved below the runtime; review of issue 19).
    import subprocess
    import sys

    code = "import kvspec_core; print(kvspec_core.runtime.KVCacheAllocator.__name__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "KVCacheAllocator"
