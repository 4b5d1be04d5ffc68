"""``kvspec plan`` with an installed plugin whose spec method raises: one error line naming the
plugin, its distribution, the kind and the method; exit 2, no traceback."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from kvspec_core.cli.main import EXIT_USAGE, main
from kvspec_core.models.catalog import load_preset

_FAULTY_PLUGIN_TEMPLATE = """
    import attrs
    from typing import ClassVar
    from kvspec_core import FullAttentionSpec, hookimpl

    kvspec_contract_version = 1

    @attrs.frozen(kw_only=True)
    class FaultySpec(FullAttentionSpec):
        kind: ClassVar[str] = "faulty_attention"

{method}

    @hookimpl
    def kvspec_register_spec_kinds(register):
        register(FaultySpec)

    @hookimpl
    def kvspec_layer_spec(layer):
        if layer.layer_type != "faulty_attention":
            return None
        return FaultySpec(**layer.attention_spec_fields())
"""


def _faulty_plugin(method: str) -> str:
    """The plugin's source with ``method`` (indented source of one method) in its spec."""
    return _FAULTY_PLUGIN_TEMPLATE.replace(
        "{method}", textwrap.indent(textwrap.dedent(method), " " * 8)
    )


def _plan_faulty(
    fake_dist,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
    method: str,
) -> tuple[int, str]:
    fake_dist("kvspec-faulty", "faulty", "kvspec_faulty", _faulty_plugin(method))
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                **load_preset("llama-3.1-8b"),
                "num_hidden_layers": 2,
                "layer_types": ["faulty_attention"] * 2,
            }
        )
    )
    status = main(["plan", str(config), "--memory", "8GiB"])
    return status, capsys.readouterr().err


def test_plan_names_the_plugin_whose_spec_raised(
    fake_dist,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    status, error = _plan_faulty(
        fake_dist,
        tmp_path,
        capsys,
        """
        def max_blocks_per_request(self, ctx):
            return 1 // 0
    """,
    )
    assert status == EXIT_USAGE
    assert error.startswith(
        "kvspec: error: plugin 'faulty' (distribution kvspec-faulty) raised "
        "ZeroDivisionError in FaultySpec.max_blocks_per_request of spec kind "
        "'faulty_attention' while planning the KV cache"
    )
    assert "Traceback" not in error and len(error.splitlines()) == 1


@pytest.mark.parametrize(
    "method, answer",
    [
        (
            "@property\ndef state_content_size_bytes(self):\n    return 0\n",
            "FaultySpec.state_content_size_bytes of spec kind 'faulty_attention' returned 0 "
            "(type int) for layer model.layers.0",
        ),
        (
            "@property\ndef page_size_bytes(self):\n    return '4096'\n",
            "FaultySpec.page_size_bytes of spec kind 'faulty_attention' returned '4096' (type str) "
            "for layer model.layers.0",
        ),
        (
            "def max_blocks_per_request(self, ctx):\n    return -3\n",
            "FaultySpec.max_blocks_per_request of spec kind 'faulty_attention' returned -3 "
            "(type int) for layer model.layers.0",
        ),
    ],
)
def test_plan_names_the_plugin_whose_spec_answered_an_unusable_value(
    fake_dist,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
    method: str,
    answer: str,
) -> None:
    """0 used to end in a ZeroDivisionError traceback from the budget split, a str in a
    TypeError traceback, -3 in a plan of more requests than fit."""
    status, error = _plan_faulty(fake_dist, tmp_path, capsys, method)
    assert status == EXIT_USAGE
    assert error.startswith(
        f"kvspec: error: plugin 'faulty' (distribution kvspec-faulty): {answer}"
    )
    assert "but it must be" in error and "KVSPEC_PLUGINS" in error
    assert "Traceback" not in error and len(error.splitlines()) == 1


def test_plan_with_a_merge_that_is_no_classmethod_names_the_plugin(
    fake_dist,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:
    """It used to end in a TypeError traceback naming no plugin."""
    status, error = _plan_faulty(
        fake_dist,
        tmp_path,
        capsys,
        """
        def merge(self, specs, layer_names=()):
            return self
    """,
    )
    assert status == EXIT_USAGE
    assert error.startswith(
        "kvspec: warning: kvspec plugin 'faulty' from distribution "
        "kvspec-faulty 1.0 failed to load: "
    )
    assert "whose merge (defined in FaultySpec) is not a classmethod" in error
    assert "'faulty_attention', which no loaded plugin claims" in error
    assert "Traceback" not in error
