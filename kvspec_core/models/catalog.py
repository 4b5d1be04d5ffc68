"""The bundled model presets, and resolving a MODEL argument (preset, config file or folder).

Each preset is a published ``config.json`` copied byte for byte into
``kvspec_core/models/presets/<name>.json`` so the package works offline. A preset name is
looked up first, then a path (use ``./name`` to force a path that shadows a preset name),
then a Hugging Face hub id (``org/name``) in the local hub cache (:mod:`kvspec_core.models.hub`).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import attrs

from kvspec_core.errors import ConfigError, UnknownNameError
from kvspec_core.models.config_file import parse_config_text, read_config
from kvspec_core.models.hub import hub_config_path, parse_hub_id

#: Preset name -> the Hugging Face repository its config.json was published in.
PRESET_SOURCES: Mapping[str, str] = {
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "phi-3-mini": "microsoft/Phi-3-mini-4k-instruct",
    "gemma-2-9b": "google/gemma-2-9b-it",
    "gpt-oss-20b": "openai/gpt-oss-20b",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite",
    "llama-4-scout": "meta-llama/Llama-4-Scout-17B-16E-Instruct",
    "jamba-1.5-mini": "ai21labs/AI21-Jamba-1.5-Mini",
    "nemotron-h-56b": "nvidia/Nemotron-H-56B-Base-8K",
    "qwen3-next-80b": "Qwen/Qwen3-Next-80B-A3B-Thinking",
    "whisper-large-v3": "openai/whisper-large-v3",
}

_PRESET_FOLDER = "presets"


@attrs.frozen(kw_only=True, eq=False)
class ResolvedModel:
    """A MODEL argument resolved to its config.

    Attributes:
        name: the preset name, the path or the hub id as given.
        config: the parsed config.json.
        preset: whether it is a bundled preset.
        source: where the config came from: ``preset``, ``config file`` or ``hub cache``.
        path: the config.json read (``None`` for a preset).
    """

    name: str
    config: Mapping[str, Any]
    preset: bool
    source: str = "config file"
    path: Path | None = None


def preset_names() -> list[str]:
    """Bundled preset names, in catalogue order."""
    return list(PRESET_SOURCES)


def preset_text(name: str) -> str:
    """The bundled config.json text of preset ``name``."""
    if name not in PRESET_SOURCES:
        raise unknown_preset_error(name)
    # One name per joinpath: Traversable.joinpath takes several only from Python 3.11.
    folder = resources.files("kvspec_core.models").joinpath(_PRESET_FOLDER)
    resource = folder.joinpath(f"{name}.json")
    return resource.read_text(encoding="utf-8")


def load_preset(name: str) -> dict[str, Any]:
    """The parsed config of preset ``name``."""
    return parse_config_text(preset_text(name), f"preset {name}")


def close_preset_names(name: str, limit: int = 4) -> list[str]:
    """Preset names close to ``name`` (for "did you mean" messages)."""
    lowered = {preset.lower(): preset for preset in PRESET_SOURCES}
    matches = difflib.get_close_matches(name.lower(), list(lowered), n=limit, cutoff=0.5)
    return [lowered[match] for match in matches]


def unknown_preset_error(name: str) -> UnknownNameError:
    close = close_preset_names(name)
    hint = f"close preset names: {', '.join(close)}" if close else "no preset name is close"
    return UnknownNameError(
        f"unknown model {name!r}: it is neither a bundled preset nor an existing config.json "
        f"or model folder; {hint}. `kvspec models` lists every preset"
    )


def _is_existing_path(model: str) -> bool:
    """Whether MODEL names an existing file or folder; a name the OS refuses as a path (too
    long, ENAMETOOLONG) is a :class:`ConfigError` naming MODEL, not a traceback."""
    try:
        return Path(model).exists()
    except OSError as error:
        shown = repr(model) if len(model) <= 60 else f"{model[:60]!r}… ({len(model)} characters)"
        raise ConfigError(
            f"MODEL {shown} cannot be used as a path: {error.strerror}; pass a preset name "
            "(`kvspec models` lists them), a config.json path, or a folder holding one"
        ) from None


def resolve_model(model: str) -> ResolvedModel:
    """A preset name, a ``config.json`` path, a folder holding one, or a Hugging Face hub id
    (``org/name``, ``org/name@revision``) resolved to its config, in that priority: a preset
    or an existing path is never looked up on the hub."""
    if not model.strip():
        # Path("") is the current folder; an empty MODEL must not plan whatever is there.
        raise ConfigError(
            "MODEL is empty; pass a preset name (`kvspec models` lists them), a config.json "
            "path, or a folder holding one"
        )
    if model in PRESET_SOURCES:
        return ResolvedModel(name=model, config=load_preset(model), preset=True, source="preset")
    if _is_existing_path(model):
        return ResolvedModel(name=model, config=read_config(model), preset=False, path=Path(model))
    hub_id = None if model.endswith(".json") else parse_hub_id(model)
    if hub_id is not None:
        path = hub_config_path(*hub_id)
        return ResolvedModel(
            name=model, config=read_config(path), preset=False, source="hub cache", path=path
        )
    if model.endswith(".json") or "/" in model:
        raise ConfigError(
            f"model config {model} does not exist; pass a config.json path, a folder holding "
            f"one, or a preset name (close ones: {', '.join(close_preset_names(model)) or 'none'})"
        )
    raise unknown_preset_error(model)
