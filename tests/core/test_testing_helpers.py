"""The helpers ``kvspec_core.testing`` gives plugin authors: real layers, registration, the
spec protocol checks."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import MappingProxyType

import attrs
import pytest
import torch

from kvspec_core import FullAttentionSpec, PlanOptions, PluginManager, SizingContext
from kvspec_core.errors import UnknownNameError
from kvspec_core.models.catalog import load_preset
from kvspec_core.models.ingest import model_layers
from kvspec_core.plugins.contract import CONTRACT_VERSION, hookimpl
from kvspec_core.testing import (
    check_sizing_invariants,
    check_spec_protocol,
    kvspec_imports_outside,
    manager_with,
    model_layer,
    model_layers_of,
    plugins_cli_report,
    registered,
)


# --------------------------------------------------------------------------- real layers
def test_model_layers_of_is_what_the_core_ingestion_builds() -> None:
    config = load_preset("llama-3.1-8b")
    manager = PluginManager()
    options = PlanOptions(block_size=32, tensor_parallel_size=2)
    layers = model_layers_of(config, manager, options)
    expected = model_layers(config, options, manager).layers
    assert len(layers) == len(expected) == 32
    for got, want in zip(layers, expected, strict=True):
        assert (
            got.index,
            got.name,
            got.layer_type,
            got.options,
            got.model_dtype,
            got.attention,
        ) == (
            want.index,
            want.name,
            want.layer_type,
            want.options,
            want.model_dtype,
            want.attention,
        )
    # Llama-3.1-8B: 8 KV heads of 128 split over 2 ranks.
    assert (layers[0].attention.num_kv_heads, layers[0].attention.total_kv_heads) == (4, 8)


def test_model_layer_picks_by_model_index_with_default_options() -> None:
    config = load_preset("gemma-2-9b")
    layer = model_layer(config, 3, PluginManager())
    assert (layer.index, layer.name, layer.layer_type) == (3, "model.layers.3", "full_attention")
    assert layer.options == PlanOptions()
    assert isinstance(layer.config, MappingProxyType)
    assert layer.attention is not None and layer.attention.head_size == 256
    assert model_layer(config, 2, PluginManager()).layer_type == "sliding_attention"


def test_model_layer_reads_a_nested_text_config() -> None:
    layer = model_layer(load_preset("llama-4-scout"), 0, PluginManager())
    assert (layer.name, layer.layer_type) == ("model.layers.0", "chunked_attention")
    assert layer.config["attention_chunk_size"] == 8192


def test_model_layer_refuses_an_index_without_a_cache_layer() -> None:
    manager = PluginManager()
    with pytest.raises(LookupError, match="no cache-holding layer at index 32"):
        model_layer(load_preset("llama-3.1-8b"), 32, manager)
    # Nemotron-H's MLP-only layers hold no cache, so the core builds none for them.
    with pytest.raises(LookupError, match="index 1;"):
        model_layer(load_preset("nemotron-h-56b"), 1, manager)


def test_model_layer_refuses_a_kv_dtype_the_manager_lacks() -> None:
    with pytest.raises(UnknownNameError, match="int2_magic"):
        model_layer(
            load_preset("llama-3.1-8b"),
            0,
            PluginManager(),
            options=PlanOptions(kv_cache_dtype="int2_magic"),
        )


# --------------------------------------------------------------------------- registered()
class _NoOpPlugin:
    """A plugin object implementing no hook: registration alone is what is tested."""

    kvspec_contract_version = CONTRACT_VERSION


def test_registered_unregisters_after_the_block() -> None:
    manager = PluginManager()
    with registered(manager, _NoOpPlugin(), "noop") as info:
        assert info.name == "noop" and manager.is_loaded("noop")
    assert not manager.is_loaded("noop")


def test_registered_unregisters_when_the_block_raises() -> None:
    manager = PluginManager()
    with pytest.raises(RuntimeError, match="boom"), registered(manager, _NoOpPlugin(), "noop"):
        raise RuntimeError("boom")
    assert not manager.is_loaded("noop")


def test_registered_tolerates_the_block_unregistering_itself() -> None:
    manager = PluginManager()
    with registered(manager, _NoOpPlugin(), "noop"):
        manager.unregister("noop")
    assert not manager.is_loaded("noop")


def test_manager_with_holds_only_the_core_and_the_plugin() -> None:
    manager = manager_with(_NoOpPlugin(), "noop")
    assert manager.is_loaded("noop")
    assert [info.name for info in manager.plugins] == ["core", "noop"]
    assert manager_with(_NoOpPlugin(), "noop") is not manager


# --------------------------------------------------------------------------- CLI and imports
def test_plugins_cli_report_loads_only_the_allowed_plugins() -> None:
    report = plugins_cli_report("no_such_plugin")
    assert report["plugins"] == []
    assert "failed" in report


def test_plugins_cli_report_raises_when_the_command_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.executable", "false")
    with pytest.raises(subprocess.CalledProcessError):
        plugins_cli_report("no_such_plugin")


def test_kvspec_imports_outside_lists_each_foreign_kvspec_import(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text(
        "import os\n"
        "import kvspec_core.specs\n"
        "from kvspec_mine import thing\n"
        "from . import sibling\n"
        "import kvspec_other.plugin as other\n"
        "def later():\n"
        "    from kvspec_third.x import y\n"
    )
    found = kvspec_imports_outside([source], {"kvspec_core", "kvspec_mine"})
    assert found == [f"{source}: kvspec_other.plugin", f"{source}: kvspec_third.x"]
    assert (
        kvspec_imports_outside(
            [source], {"kvspec_core", "kvspec_mine", "kvspec_other", "kvspec_third"}
        )
        == []
    )


# --------------------------------------------------------------------------- check_spec_protocol
def _full() -> FullAttentionSpec:
    return _llama_like(FullAttentionSpec)


def _llama_like(spec_class: type) -> FullAttentionSpec:
    """Llama-like geometry (8 KV heads of 128, bf16, block 16) in ``spec_class``."""
    return spec_class(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def test_a_core_spec_passes_the_protocol() -> None:
    check_spec_protocol(_full(), PluginManager())


@attrs.frozen(kw_only=True)
class _TwoFormulaSpec(FullAttentionSpec):
    """Startup sizing that disagrees with the admission cap (one block too many)."""

    kind = "two_formula_test"

    def max_memory_usage_bytes(self, ctx):  # type: ignore[no-untyped-def]
        return super().max_memory_usage_bytes(ctx) + self.page_size_bytes


@attrs.frozen(kw_only=True)
class _MergeLosingSpec(FullAttentionSpec):
    """Merging equal copies returns another spec."""

    kind = "merge_losing_test"

    @classmethod
    def merge(cls, specs, layer_names):  # type: ignore[no-untyped-def, override]
        return attrs.evolve(specs[0], block_size=specs[0].block_size * 2)


@attrs.frozen(kw_only=True)
class _ShrinkingSpec(FullAttentionSpec):
    """Per-request memory that falls once ``max_model_len`` passes 4096."""

    kind = "shrinking_test"

    def max_blocks_per_request(self, ctx):  # type: ignore[no-untyped-def]
        return 1 if ctx.max_model_len > 4096 else super().max_blocks_per_request(ctx)

    def max_memory_usage_bytes(self, ctx):  # type: ignore[no-untyped-def]
        return self.max_blocks_per_request(ctx) * self.page_size_bytes


@attrs.frozen(kw_only=True)
class _BusyShrinkingSpec(FullAttentionSpec):
    """An admission cap that falls once more than 1000 tokens are in flight."""

    kind = "busy_shrinking_test"

    def max_blocks_per_request(self, ctx):  # type: ignore[no-untyped-def]
        return 1 if ctx.max_in_flight_tokens > 1000 else super().max_blocks_per_request(ctx)

    def max_memory_usage_bytes(self, ctx):  # type: ignore[no-untyped-def]
        return self.max_blocks_per_request(ctx) * self.page_size_bytes


@attrs.frozen(kw_only=True)
class _NarrowingTableSpec(FullAttentionSpec):
    """A block-table row that narrows once ``max_model_len`` passes 4096."""

    kind = "narrowing_table_test"

    def block_table_width(self, ctx, max_len):  # type: ignore[no-untyped-def]
        return 1 if max_len > 4096 else super().block_table_width(ctx, max_len)


class _Kinds:
    """Registers the broken test kinds, as a plugin would."""

    kvspec_contract_version = CONTRACT_VERSION

    @staticmethod
    @hookimpl
    def kvspec_register_spec_kinds(register):  # type: ignore[no-untyped-def]
        for cls in (_TwoFormulaSpec, _MergeLosingSpec, _ShrinkingSpec):
            register(cls)


@pytest.mark.parametrize(
    "spec_class, message",
    [
        (_TwoFormulaSpec, "startup sizing and runtime admission must use one formula"),
        (_MergeLosingSpec, "merging equal specs changed the spec"),
        (_ShrinkingSpec, "per-request memory decreased at max_model_len=131072"),
    ],
)
def test_a_spec_breaking_a_rule_is_reported(spec_class: type, message: str) -> None:
    manager = PluginManager()
    with (
        registered(manager, _Kinds(), "broken_kinds"),
        pytest.raises(AssertionError, match=message),
    ):
        check_spec_protocol(_llama_like(spec_class), manager)


@attrs.frozen(kw_only=True)
class _EmptyCellSpec(FullAttentionSpec):
    """Cells of 0 bytes: the budget split used to divide by zero."""

    kind = "empty_cell_test"

    @property
    def state_content_size_bytes(self):  # type: ignore[no-untyped-def]
        return 0


@attrs.frozen(kw_only=True)
class _TextPageSpec(FullAttentionSpec):
    """A page size given as text."""

    kind = "text_page_test"

    @property
    def page_size_bytes(self):  # type: ignore[no-untyped-def]
        return "4096"


@attrs.frozen(kw_only=True)
class _BoolHeadsSpec(FullAttentionSpec):
    """A head count that is a bool (an int to Python)."""

    kind = "bool_heads_test"

    @property
    def num_heads(self):  # type: ignore[no-untyped-def]
        return True


@attrs.frozen(kw_only=True)
class _NegativeCapSpec(FullAttentionSpec):
    """A negative admission cap, consistent with its startup sizing and never decreasing."""

    kind = "negative_cap_test"

    def max_blocks_per_request(self, ctx):  # type: ignore[no-untyped-def]
        return -8


class _AnswerKinds:
    """Registers the kinds whose answers are unusable, as a plugin would."""

    kvspec_contract_version = CONTRACT_VERSION

    @staticmethod
    @hookimpl
    def kvspec_register_spec_kinds(register):  # type: ignore[no-untyped-def]
        for cls in (_EmptyCellSpec, _TextPageSpec, _BoolHeadsSpec, _NegativeCapSpec):
            register(cls)


@pytest.mark.parametrize(
    "spec_class, message",
    [
        (_EmptyCellSpec, "_EmptyCellSpec.state_content_size_bytes .* returned 0 .* positive int"),
        (_TextPageSpec, "_TextPageSpec.page_size_bytes .* returned '4096' .type str."),
        (_BoolHeadsSpec, "_BoolHeadsSpec.num_heads .* returned True .type bool."),
        (
            _NegativeCapSpec,
            "_NegativeCapSpec.max_blocks_per_request .* returned -8 .* non-negative",
        ),
    ],
)
def test_a_spec_answering_an_unusable_size_is_reported(spec_class: type, message: str) -> None:
    """Each of these passed the protocol and then broke the planner (ZeroDivisionError,
    TypeError) or planned more requests than fit (the negative cap)."""
    manager = PluginManager()
    with (
        registered(manager, _AnswerKinds(), "answer_kinds"),
        pytest.raises(AssertionError, match=message),
    ):
        check_spec_protocol(_llama_like(spec_class), manager)


def test_an_unregistered_kind_is_refused() -> None:
    with pytest.raises(Exception, match="two_formula_test"):
        check_spec_protocol(_llama_like(_TwoFormulaSpec), PluginManager())


@attrs.frozen(kw_only=True)
class _UnregisteredFull(FullAttentionSpec):
    """Inherits full attention's kind but is not registered: it would serialise as its parent."""


def test_a_spec_known_only_through_its_parent_is_refused() -> None:
    with pytest.raises(
        AssertionError,
        match=r"_UnregisteredFull .kind 'full_attention'. is not "
        r"registered itself.*through FullAttentionSpec",
    ):
        check_spec_protocol(_llama_like(_UnregisteredFull), PluginManager())


def test_a_core_spec_keeps_the_sizing_invariants() -> None:
    ctx = SizingContext(max_model_len=1000, max_in_flight_tokens=512, dcp_size=2)
    check_sizing_invariants(_full(), ctx, longer_by=1 << 20, busier_by=1 << 16)
    check_sizing_invariants(_full(), ctx, longer_by=0, busier_by=0)


@pytest.mark.parametrize(
    "spec_class, message",
    [
        (_TwoFormulaSpec, "startup sizing and runtime admission must use one formula"),
        (
            _ShrinkingSpec,
            "per-request memory fell from 4128768 to 65536 when max_model_len grew "
            "from 1000 to 5000",
        ),
        (_NarrowingTableSpec, "block-table width fell from 63 to 1 when max_model_len grew"),
        (
            _BusyShrinkingSpec,
            "admission cap fell from 63 to 1 when max_in_flight_tokens grew from 512 to 1512",
        ),
    ],
)
def test_a_spec_breaking_a_sizing_invariant_is_reported(spec_class: type, message: str) -> None:
    # 1000 tokens in blocks of 16 is 63 blocks of 16 × 8 × 128 × 2 × 2 = 65536 bytes.
    ctx = SizingContext(max_model_len=1000, max_in_flight_tokens=512)
    with pytest.raises(AssertionError, match=message):
        check_sizing_invariants(_llama_like(spec_class), ctx, longer_by=4000, busier_by=1000)
