"""Which families (layer types, spec kinds, plugin distributions) a model needs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from kvspec_core.errors import KVSpecError
from kvspec_core.models.ingest import CORE_LAYER_TYPES, layer_specs, model_layers
from kvspec_core.plugins.known_families import LAYER_TYPE_DISTRIBUTIONS
from kvspec_core.plugins.layer_config import PlanOptions

if TYPE_CHECKING:
    from kvspec_core.plugins.manager import PluginManager

CORE_DISTRIBUTION = "kvspec-core"


def distribution_of_layer_type(layer_type: str) -> str | None:
    """The distribution that claims ``layer_type``; ``None`` for third-party types."""
    if layer_type in CORE_LAYER_TYPES:
        return CORE_DISTRIBUTION
    return LAYER_TYPE_DISTRIBUTIONS.get(layer_type)


@attrs.frozen(kw_only=True)
class ModelFamilies:
    """What a model needs from kvspec.

    Attributes:
        layer_types: normalised layer type -> number of layers, in first-seen order.
        distributions: distributions providing those types (``kvspec-core`` included).
        spec_kinds: spec kind -> number of layers, when every layer was claimed; else empty.
        missing: distributions needed but not loaded in the manager.
        error: why specs could not be built (``None`` when they were).
        default_max_model_len: the default max model length (max_position_embeddings; Whisper:
            max_target_positions).
    """

    layer_types: Mapping[str, int]
    distributions: tuple[str, ...]
    spec_kinds: Mapping[str, int]
    missing: tuple[str, ...]
    error: str | None
    default_max_model_len: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_types": dict(self.layer_types),
            "distributions": list(self.distributions),
            "spec_kinds": dict(self.spec_kinds),
            "missing_distributions": list(self.missing),
            "error": self.error,
            "default_max_model_len": self.default_max_model_len,
        }


def model_families(
    config: Mapping[str, Any], manager: PluginManager, *, name: str = "model"
) -> ModelFamilies:
    """The families ``config`` needs at default options, and whether ``manager`` has them."""
    model = model_layers(config, PlanOptions(), manager, name=name)
    types = Counter(layer.layer_type for layer in model.layers)
    distributions = tuple(
        dict.fromkeys(distribution_of_layer_type(t) or f"(unknown: {t})" for t in types)
    )
    loaded = {info.distribution for info in manager.plugins}
    missing = tuple(d for d in distributions if d not in loaded)
    try:
        specs = layer_specs(model, manager)
    except KVSpecError as error:
        return ModelFamilies(
            layer_types=dict(types),
            distributions=distributions,
            spec_kinds={},
            missing=missing,
            error=str(error),
            default_max_model_len=model.default_max_model_len,
        )
    kinds = Counter(spec.kind for spec in specs.values())
    return ModelFamilies(
        layer_types=dict(types),
        distributions=distributions,
        spec_kinds=dict(kinds),
        missing=missing,
        error=None,
        default_max_model_len=model.default_max_model_len,
    )
