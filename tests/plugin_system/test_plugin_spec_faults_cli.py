"""``kvspec plan`` with an installed plugin whose spec method raises: one error line naming the
plugin, its distribution, the kind and the method; exit 2, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec_core.cli.main import EXIT_USAGE, main
from kvspec_core.models.catalog import load_preset

_FAULTY_PLUGIN = """
    import attrs
    from typing import ClassVar
    from kvspec_core import FullAttentionSpec, hookimpl

    kvspec_contract_version = 1

    @attrs.frozen(kw_only=True)
    class FaultySpec(FullAttentionSpec):
        kind: ClassVar[str] = "faulty_attention"

        def max_blocks_per_request(self, ctx):
            return 1 // 0

    @hookimpl
    def kvspec_register_spec_kinds(register):
        register(FaultySpec)

    @hookimpl
    def kvspec_layer_spec(layer):
        if layer.layer_type != "faulty_attention":
            return None
        return FaultySpec(**layer.attention_spec_fields())
"""


def test_plan_names_the_plugin_whose_spec_raised(
    fake_dist, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    fake_dist("kvspec-faulty", "faulty", "kvspec_faulty", _FAULTY_PLUGIN)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**load_preset("llama-3.1-8b"), "num_hidden_layers": 2,
                                  "layer_types": ["faulty_attention"] * 2}))
    status = main(["plan", str(config), "--memory", "8GiB"])
    error = capsys.readouterr().err
    assert status == EXIT_USAGE
    assert error.startswith("kvspec: error: plugin 'faulty' (distribution kvspec-faulty) raised "
                            "ZeroDivisionError in FaultySpec.max_blocks_per_request of spec kind "
                            "'faulty_attention' while planning the KV cache")
    assert "Traceback" not in error and len(error.splitlines()) == 1
