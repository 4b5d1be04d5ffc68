"""Reading config.json files and folders, including non-standard JSON literals."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from kvspec_core.errors import ConfigError
from kvspec_core.models.config_file import MAX_CONFIG_BYTES, read_config


def test_a_folder_reads_the_config_json_inside(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert read_config(tmp_path) == {"model_type": "llama"}
    assert read_config(tmp_path / "config.json") == {"model_type": "llama"}


def test_bare_infinity_and_nan_literals_are_accepted(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"time_step_limit": [0.0, Infinity], "x": NaN, "y": -Infinity}')
    config = read_config(path)
    assert config["time_step_limit"] == [0.0, math.inf]
    assert math.isnan(config["x"]) and config["y"] == -math.inf


def test_a_folder_without_config_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("holds no config.json")):
        read_config(tmp_path)


def test_a_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        read_config(tmp_path / "nope.json")


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON list"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ],
)
def test_malformed_configs_are_refused(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        read_config(path)


def test_an_oversized_file_is_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    with path.open("wb") as handle:
        handle.truncate(MAX_CONFIG_BYTES + 1)  # sparse: nothing is written or read
    with pytest.raises(ConfigError, match="not a weights file"):
        read_config(path)


def test_an_integer_literal_too_long_to_convert_is_refused(tmp_path: Path) -> None:
    # Python refuses to convert integer literals over 4300 digits (ValueError, not a
    # JSONDecodeError); that must surface as a ConfigError, not a traceback.
    path = tmp_path / "config.json"
    path.write_text('{"num_hidden_layers": ' + "9" * 5000 + "}")
    with pytest.raises(ConfigError, match=r"is not valid JSON.*digits"):
        read_config(path)
