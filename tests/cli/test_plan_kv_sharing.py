"""``kvspec plan --json`` on a model whose layers share KV: ``memoryless_layers`` lists the
readers and ``kv_sharing`` names the layer each reads (Gemma-3n's ``num_kv_shared_layers``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from plan_cli_testkit import plan_json


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
        {"layer": "model.layers.6", "reads": "model.layers.5"},
        {"layer": "model.layers.7", "reads": "model.layers.5"},
        {"layer": "model.layers.8", "reads": "model.layers.5"},
        {"layer": "model.layers.9", "reads": "model.layers.4"},
    ]
    planned = {layer for group in report["groups"] for layer in group["layers"]}
    assert planned.isdisjoint(readers)


def test_a_model_without_sharing_has_an_empty_list(capsys: pytest.CaptureFixture[str]) -> None:
    report = plan_json(capsys, "llama-3.1-8b", "--memory", "40GiB")
    assert report["kv_sharing"] == []
