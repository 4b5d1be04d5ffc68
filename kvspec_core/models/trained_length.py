"""The longest request a model was built for, as vLLM derives it (``_get_and_verify_max_len``
in vLLM's ``config/model.py``): the config's length field (``max_position_embeddings``, an
encoder-decoder's decoder positions, ...) times the RoPE scaling factor of the scaling types
that do not already count it there (``linear``, ``dynamic``; not ``llama3``, ``yarn``,
``longrope``/``su``, ``deepseek_yarn``; never for Gemma 3). vLLM refuses a longer
``max_model_len`` unless told to allow it: positions past it are untrained (NaNs with RoPE,
out-of-bounds reads with learned positions), so a plan for them describes no working
deployment."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from kvspec_core.errors import ConfigError
from kvspec_core.models.ingest import ModelLayers
from kvspec_core.models.rope_and_type_fields import is_scaling_factor
from kvspec_core.validation import MAX_FIELD_VALUE

#: RoPE scaling types whose factor is already in the config's length (vLLM's list).
_LENGTH_ALREADY_SCALED = frozenset(
    {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
)


def _rope_parameters(fields: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """Each RoPE parameter set of the config (one, or one per layer type)."""
    for name in ("rope_scaling", "rope_parameters"):
        value = fields.get(name)
        if not isinstance(value, Mapping):
            continue
        if "rope_type" in value or "type" in value:
            yield value
        else:
            yield from (item for item in value.values() if isinstance(item, Mapping))


def trained_max_model_len(model: ModelLayers) -> tuple[int, str] | None:
    """The longest request ``model`` was built for and where it comes from (for messages),
    or None when its config names no length."""
    base = model.default_max_model_len
    if base is None:
        return None
    fields = model.config
    factor = 1.0
    if "gemma3" not in str(fields.get("model_type", "")):
        for params in _rope_parameters(fields):
            kind = params.get("rope_type", params.get("type"))
            value = params.get("factor")
            if kind not in _LENGTH_ALREADY_SCALED and is_scaling_factor(value):
                factor = float(value)  # type: ignore[arg-type]  # checked above
    if factor == 1.0:
        return base, "the config's length"
    scaled = base * factor
    if not scaled <= MAX_FIELD_VALUE:
        raise ConfigError(
            f"the config's RoPE scaling factor {factor:g} ('rope_scaling' / 'rope_parameters' "
            f"'factor') times its length {base:,} is {scaled:g} tokens, beyond kvspec's "
            f"limit of {MAX_FIELD_VALUE:,}; fix the factor in the model config"
        )
    return int(scaled), f"the config's length {base:,} x its RoPE scaling factor {factor:g}"


def default_plan_length(model: ModelLayers) -> int | None:
    """The max_model_len vLLM plans when none is given: the trained length
    (:func:`trained_max_model_len`, RoPE factor included), except with LongRoPE, whose
    default is the config's ``original_max_position_embeddings`` (vLLM: to avoid degrading
    shorter sequences); None when the config names no length."""
    trained = trained_max_model_len(model)
    if trained is None:
        return None
    fields = model.config
    original = fields.get("original_max_position_embeddings")
    longrope = any(
        params.get("rope_type", params.get("type")) == "longrope"
        for params in _rope_parameters(fields)
    )
    if longrope and isinstance(original, int) and not isinstance(original, bool) and original > 0:
        return min(original, trained[0])
    return trained[0]
