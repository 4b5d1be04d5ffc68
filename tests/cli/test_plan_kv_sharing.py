"""``kvspec plan --json`` on a model whose layers share KV: ``memoryless_layers`` lists the
readers and ``kv_sharing`` names the layer each reads (Gemma-3n's ``num_kv_shared_layers``),
with the plan document's keys (``layer``, ``source``); with ``--pp``, over every stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from plan_cli_testkit import plan_json

from kvspec_core.cli.main import main


def test_json_names_the_layer_each_reader_reads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # transformers' Gemma-3n pattern: 4 sliding then 1 full. The last 4 layers share: the
    # sliding ones (6, 7, 8) read layer 5, the last non-shared sliding layer; the full one
    # (9) reads layer 4, the last non-shared full layer.
    config = transformers.Gemma3nTextConfig(num_hidden_layers=10, num_kv_shared_layers=4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    report = plan_json(capsys, str(path), "--memory", "1GiB", "--max-model-len", "4096")
    readers = [f"model.layers.{index}" for index in (6, 7, 8, 9)]
    assert report["memoryless_layers"] == readers
    assert report["kv_sharing"] == [
        {"layer": "model.layers.6", "source": "model.layers.5"},
        {"layer": "model.layers.7", "source": "model.layers.5"},
        {"layer": "model.layers.8", "source": "model.layers.5"},
        {"layer": "model.layers.9", "source": "model.layers.4"},
    ]
    planned = {layer for group in report["groups"] for layer in group["layers"]}
    assert planned.isdisjoint(readers)


def test_a_model_without_sharing_has_an_empty_list(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB")
    assert report["kv_sharing"] == []


def _e4b(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(transformers.Gemma3nTextConfig().to_dict()))
    return str(path)


def _e4b_sharing() -> list[dict[str, str]]:
    """E4B's 15 readers: full ones (24, 29, 34) read layer 19, sliding ones layer 18."""
    return [
        {"layer": f"model.layers.{i}", "source": f"model.layers.{19 if i % 5 == 4 else 18}"}
        for i in range(20, 35)
    ]


def test_pp_reports_the_readers_of_every_stage(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """E4B at PP 2 (vLLM's split: layers 0..17, 18..34): stage 0 is the bottleneck, yet the
    readers are stage 1's; stage 1 holds a cache for layers 18 and 19 only."""
    report = plan_json(capsys, _e4b(tmp_path), "--memory", "1GiB", "--pp", "2")
    first, second = report["pipeline_stages"]
    assert report["bottleneck_stage"] == 0
    assert (first["layer_range"], second["layer_range"]) == ([0, 18], [18, 35])
    assert (first["cache_layers"], second["cache_layers"]) == (18, 2)
    assert first["kv_sharing"] == [] and first["memoryless_layers"] == []
    assert second["kv_sharing"] == _e4b_sharing()
    assert second["memoryless_layers"] == [f"model.layers.{i}" for i in range(20, 35)]
    # The top level lists every stage's, not the bottleneck stage's only.
    assert report["kv_sharing"] == _e4b_sharing()
    assert report["memoryless_layers"] == second["memoryless_layers"]


def test_pp_table_counts_only_layers_holding_a_cache(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["plan", _e4b(tmp_path), "--memory", "1GiB", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("0 ", "1 "))]
    assert [row[:3] for row in rows[:2]] == [["0", "0..17", "18"], ["1", "18..34", "2"]]
    assert "no cache         15 × model.layers.20..34 (every stage)" in out
