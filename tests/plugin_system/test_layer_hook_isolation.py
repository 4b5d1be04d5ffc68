"""A plugin whose ``kvspec_layer_spec`` raises (or answers something that is no spec) only
matters for layers no other plugin claims: elsewhere it is one warning naming it, and the
other plugins' answers stand. Before, such a plugin blocked planning every model, llama
included. ``KVSPEC_STRICT_PLUGINS=1`` keeps it an error everywhere."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from kvspec_core import (
    AttentionShape,
    LayerConfig,
    PlanOptions,
    PluginError,
    PluginManager,
    hookimpl,
)
from kvspec_core.cli.main import EXIT_USAGE, main
from kvspec_core.models.catalog import load_preset
from kvspec_core.plugins.manager import PluginHookWarning
from kvspec_core.testing import registered

_RAISING_PLUGIN = """
    from kvspec_core import hookimpl

    kvspec_contract_version = 1

    @hookimpl
    def kvspec_layer_spec(layer):
        raise RuntimeError("boom")
"""


class _Raising:
    kvspec_contract_version = 1

    @hookimpl
    def kvspec_layer_spec(self, layer: Any) -> Any:
        raise RuntimeError("boom")


class _Confused:
    kvspec_contract_version = 1

    @hookimpl
    def kvspec_layer_spec(self, layer: Any) -> Any:
        return "a spec, honest"


def _layer(index: int, layer_type: str = "full_attention") -> LayerConfig:
    return LayerConfig(
        index=index,
        name=f"model.layers.{index}",
        layer_type=layer_type,
        config={},
        options=PlanOptions(),
        model_dtype=torch.float16,
        attention=AttentionShape(
            num_kv_heads=2, total_kv_heads=2, head_size=64, head_size_v=64, dtype=torch.float16
        ),
    )


@pytest.mark.parametrize(
    "plugin, fault",
    [
        (_Raising(), "raised RuntimeError in kvspec_layer_spec"),
        (_Confused(), "returned 'a spec, honest'"),
    ],
)
def test_a_faulty_hook_is_one_warning_where_the_core_claims_the_layer(
    plugin: object, fault: str
) -> None:
    manager = PluginManager()
    manager.register(plugin, "faulty", distribution="kvspec-faulty")
    with pytest.warns(PluginHookWarning) as caught:
        claims = [manager.layer_specs(_layer(index)) for index in range(4)]
    assert [[owner for owner, _ in claim] for claim in claims] == [["core"]] * 4
    assert len(caught) == 1
    message = str(caught[0].message)
    assert message.startswith(f"plugin 'faulty' (distribution kvspec-faulty) {fault}")
    assert "plugin 'core' claims the layer" in message and "KVSPEC_PLUGINS" in message


def test_a_faulty_hook_is_an_error_where_no_other_plugin_claims_the_layer() -> None:
    manager = PluginManager()
    manager.register(_Raising(), "faulty", distribution="kvspec-faulty")
    with pytest.raises(PluginError) as raised:
        manager.layer_specs(_layer(0, "boom_attention"))
    message = str(raised.value)
    assert message.startswith(
        "plugin 'faulty' (distribution kvspec-faulty) raised RuntimeError "
        "in kvspec_layer_spec for layer model.layers.0 (boom_attention): "
        "boom; no other plugin claims that layer"
    )
    assert "leave it out with KVSPEC_PLUGINS" in message
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_strict_plugins_make_every_fault_an_error() -> None:
    manager = PluginManager(strict_plugins=True)
    with (
        registered(manager, _Raising(), "faulty"),
        pytest.raises(
            PluginError,
            match=r"plugin 'faulty' raised RuntimeError .*"
            r"KVSPEC_STRICT_PLUGINS=1 makes any plugin fault",
        ),
    ):
        manager.layer_specs(_layer(0))


def test_strict_loading_sets_strict_plugins() -> None:
    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "", "KVSPEC_STRICT_PLUGINS": "1"})
    assert manager.strict_plugins
    lenient = PluginManager()
    lenient.load_entry_points({"KVSPEC_PLUGINS": ""})
    assert not lenient.strict_plugins


def test_a_fresh_manager_warns_again() -> None:
    """Warned once per manager, not once per process."""
    for _ in range(2):
        manager = PluginManager()
        manager.register(_Raising(), "faulty")
        with pytest.warns(PluginHookWarning):
            manager.layer_specs(_layer(0))


def test_cli_plans_llama_with_one_warning_naming_the_plugin(
    fake_dist,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("KVSPEC_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("KVSPEC_PLUGINS", raising=False)
    fake_dist("kvspec-boom", "boom", "kvspec_boom", _RAISING_PLUGIN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every warning must have become a line
        status = main(["plan", "llama-3.1-8b", "--memory", "40GiB"])
    captured = capsys.readouterr()
    assert status == 0
    assert captured.err.splitlines() == [
        "kvspec: warning: plugin 'boom' (distribution kvspec-boom) raised RuntimeError in "
        "kvspec_layer_spec for layer model.layers.0 (full_attention): boom; ignored, as plugin "
        "'core' claims the layer (further faults of this plugin are not repeated; "
        "KVSPEC_STRICT_PLUGINS=1 makes them errors). This is a bug of that plugin; report it "
        "to its authors, or leave it out with KVSPEC_PLUGINS (the comma-separated plugin names "
        "to load)"
    ]
    assert "llama-3.1-8b" in captured.out


def test_cli_refuses_a_layer_only_the_faulty_plugin_could_claim_and_strict_mode(
    fake_dist,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("KVSPEC_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("KVSPEC_PLUGINS", raising=False)
    fake_dist("kvspec-boom", "boom", "kvspec_boom", _RAISING_PLUGIN)
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                **load_preset("llama-3.1-8b"),
                "num_hidden_layers": 2,
                "layer_types": ["boom_attention"] * 2,
            }
        )
    )
    assert main(["plan", str(config), "--memory", "8GiB"]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert error.startswith(
        "kvspec: error: plugin 'boom' (distribution kvspec-boom) raised "
        "RuntimeError in kvspec_layer_spec for layer model.layers.0 "
        "(boom_attention): boom; no other plugin claims that layer"
    )
    assert "KVSPEC_PLUGINS" in error and "Traceback" not in error
    assert len(error.splitlines()) == 1

    monkeypatch.setenv("KVSPEC_STRICT_PLUGINS", "1")
    assert main(["plan", "llama-3.1-8b", "--memory", "40GiB"]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert error.startswith("kvspec: error: plugin 'boom' (distribution kvspec-boom) raised")
    assert "KVSPEC_STRICT_PLUGINS=1 makes any plugin fault an error" in error


_REFUSING_PLUGIN = """
    from kvspec_core import hookimpl
    from kvspec_core.errors import ConfigError

    kvspec_contract_version = 1

    @hookimpl
    def kvspec_layer_spec(layer):
        raise ConfigError(f"layer {layer.name} lacks 'made_up_field'; fix the model config")
"""


def test_a_plugins_refusal_names_the_plugin_beside_the_config(
    fake_dist,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Found in review: a plugin refusing layers of other families (a kvspec error, taken as
    deliberate) read as the model config's fault: Llama did not plan, and no plugin was
    named. The refusal stands, with a note naming the plugin and the allow-list."""
    monkeypatch.delenv("KVSPEC_STRICT_PLUGINS", raising=False)
    monkeypatch.delenv("KVSPEC_PLUGINS", raising=False)
    fake_dist("kvspec-refuser", "refuser", "kvspec_refuser", _REFUSING_PLUGIN)
    assert main(["plan", "llama-3.1-8b", "--memory", "40GiB"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "kvspec: error: layer model.layers.0 lacks 'made_up_field'" in err
    assert "kvspec: note: raised by plugin 'refuser''s kvspec_layer_spec" in err
    assert "leave it out with KVSPEC_PLUGINS" in err
