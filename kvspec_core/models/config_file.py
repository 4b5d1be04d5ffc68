"""Reading a Hugging Face ``config.json`` (a file, or a folder holding one) into a dict."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvspec_core.errors import ConfigError

#: Name of the config file inside a model folder.
CONFIG_FILE_NAME = "config.json"
#: Larger files are refused before reading: real configs are a few KiB, and a hostile
#: path (``/dev/zero``, a checkpoint shard) must not be read into memory.
MAX_CONFIG_BYTES = 16 * 1024 * 1024

#: Bare literals some published configs carry (Nemotron-H has ``Infinity``); strict JSON
#: parsers reject them, so they are mapped explicitly here rather than by accident.
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def config_path(path: str | Path) -> Path:
    """The ``config.json`` that ``path`` names: the file itself, or the one in a folder."""
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / CONFIG_FILE_NAME
        if not candidate.is_file():
            raise ConfigError(
                f"folder {path} holds no {CONFIG_FILE_NAME}; pass the config file itself or a "
                "model folder that holds one"
            )
    elif not candidate.exists():
        raise ConfigError(f"model config {path} does not exist; pass a {CONFIG_FILE_NAME} path")
    elif not candidate.is_file():
        raise ConfigError(f"model config {path} is not a regular file; pass a {CONFIG_FILE_NAME}")
    return candidate


def parse_config_text(text: str, source: str) -> dict[str, Any]:
    """Parse config text; ``NaN``/``Infinity`` literals are accepted as floats."""
    try:
        data = json.loads(text, parse_constant=lambda name: _NON_FINITE[name])
    except (ValueError, RecursionError) as error:
        # ValueError covers JSONDecodeError and integer literals too long to convert.
        raise ConfigError(f"{source} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{source} holds a JSON {type(data).__name__}; a model config is a JSON object"
        )
    return data


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed config at ``path`` (a ``config.json`` or a folder holding one)."""
    file = config_path(path)
    size = file.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{file} is {size} bytes; a model config is at most {MAX_CONFIG_BYTES} bytes. "
            f"Pass the model's {CONFIG_FILE_NAME}, not a weights file"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"cannot read {file}: {error}") from None
    return parse_config_text(text, str(file))
