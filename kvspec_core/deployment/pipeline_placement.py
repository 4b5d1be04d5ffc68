"""Which pipeline stages vLLM builds each tensor outside the decoder layers on, per model
architecture (``pipeline_placement.json``, data beside this module, citing vLLM's model code).

vLLM splits the decoder layers over the stages, but what lies outside them depends on the
model class: Llama, Qwen2/3 and DeepSeek build the embedding only on the first stage and
the final norm and LM head only on the last, while Gemma, gpt-oss, Jamba, Nemotron-H,
Mixtral and the Qwen MoE classes build them on every stage, and Llama-4's and Gemma-3's
vision towers are on every stage too. An architecture the table does not list is refused
at ``--pp`` above 1 rather than given Llama's (optimistic) split.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

import attrs

from kvspec_core.errors import ConfigError

FIRST = "first"
LAST = "last"
EVERY = "every"
_PLACES = (FIRST, LAST, EVERY)
_TABLE_FILE = "pipeline_placement.json"
_PARTS = ("embedding", "lm_head", "after_layers", "before_layers")


@attrs.frozen(kw_only=True)
class StagePlacement:
    """Where one architecture's tensors outside the decoder layers live.

    Attributes:
        architecture: the vLLM architecture name.
        embedding: the input vocabulary table (``first``: also on the last stage when tied).
        lm_head: an untied LM head.
        after_layers: the other tensors after the decoder layers (the final norm).
        before_layers: the other tensors before them (a vision tower, its projector).
        source: the vLLM file and lines that say so.
    """

    architecture: str
    embedding: str
    lm_head: str
    after_layers: str
    before_layers: str
    source: str


@functools.cache
def _table() -> dict[str, Any]:
    text = resources.files(__package__).joinpath(_TABLE_FILE).read_text(encoding="utf-8")
    table: dict[str, Any] = json.loads(text)
    return table


def _entry(architecture: str, entry: Any) -> StagePlacement:
    if not isinstance(entry, dict) or any(entry.get(part) not in _PLACES for part in _PARTS):
        raise ConfigError(
            f"{_TABLE_FILE}: the entry for {architecture!r} needs each of {', '.join(_PARTS)} "
            f"set to one of {', '.join(_PLACES)}"
        )
    return StagePlacement(
        architecture=architecture,
        source=str(entry.get("source", "")),
        **{part: entry[part] for part in _PARTS},
    )


def stage_placement(architecture: str) -> StagePlacement:
    """The placement of ``architecture``'s tensors outside the decoder layers; a
    :class:`ConfigError` naming the class and the fix when vLLM refuses pipeline
    parallelism for it or the table does not know it."""
    table = _table()
    refused = table["no_pipeline_parallelism"].get(architecture)
    if refused is not None:
        raise ConfigError(
            f"vLLM runs {architecture} without pipeline parallelism ({refused}); "
            "plan it with --pp 1"
        )
    entry = table["architectures"].get(architecture)
    if entry is None:
        raise ConfigError(
            f"--pp: kvspec does not know which pipeline stages vLLM builds {architecture}'s "
            "embedding, LM head and final norm on (many vLLM classes build them on every "
            "stage, not only the first and last), so the weights per stage are not known; "
            "plan with --pp 1, or measure the KV budget vLLM reports on the GPU and pass it "
            f"as --memory; to add the class, read its vLLM model file and list it in "
            f"kvspec_core/deployment/{_TABLE_FILE}"
        )
    return _entry(architecture, entry)


def stages_holding(place: str, stages: int) -> range | tuple[int, ...]:
    """The stage indices (of ``stages``) a tensor placed at ``place`` lives on."""
    if place == EVERY:
        return range(stages)
    return (0,) if place == FIRST else (stages - 1,)
