"""Model configs to layer specs: what plugins see of a layer, config ingestion, presets."""

from kvspec_core.models.layer import AttentionShape, LayerConfig, PlanOptions

__all__ = ["AttentionShape", "LayerConfig", "PlanOptions"]
