"""Layer counts: a config beyond :data:`MAX_LAYERS` is refused at once naming the field; one
at the limit plans (benchmarks/plan_many_layers.py times it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec_core.cli.main import EXIT_USAGE, main
from kvspec_core.models.catalog import load_preset
from kvspec_core.models.fields import MAX_LAYERS

#: The deepest published model kvspec has seen (Llama-3.1-405B); the limit must stay far above.
DEEPEST_PUBLISHED_LAYERS = 126


def llama_with_layers(folder: Path, layers: int) -> Path:
    path = folder / f"llama-{layers}-layers.json"
    path.write_text(json.dumps({**load_preset("llama-3.1-8b"), "num_hidden_layers": layers}))
    return path


def test_the_limit_is_far_above_real_models() -> None:
    assert MAX_LAYERS >= 50 * DEEPEST_PUBLISHED_LAYERS


@pytest.mark.parametrize("layers", [MAX_LAYERS + 1, 100_000])
def test_a_config_beyond_the_limit_is_refused_naming_the_field(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    layers: int,
) -> None:
    config = llama_with_layers(tmp_path, layers)
    assert main(["plan", str(config), "--memory", "1TiB", "--max-model-len", "4096"]) == EXIT_USAGE
    error = capsys.readouterr().err
    assert error.startswith("kvspec: error: ")
    assert f"'num_hidden_layers' is {layers}" in error and f"[1, {MAX_LAYERS}]" in error


def test_a_config_at_the_limit_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = llama_with_layers(tmp_path, MAX_LAYERS)
    assert main(["plan", str(config), "--memory", "1TiB", "--max-model-len", "4096", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (group,) = report["groups"]
    assert len(group["layers"]) == MAX_LAYERS
    assert group["page_size_bytes"] == MAX_LAYERS * 16 * 8 * (128 + 128) * 2
    assert report["num_blocks"] == report["pools"][0]["num_blocks"]
