"""Pipeline parallelism: each stage holds a contiguous run of the model's layers, on its own
GPU with the same per-GPU budget, and plans its own KV cache. A request runs through every
stage, so the model's concurrency is the least over the stages (engines then give every stage
the block count of the tightest one).

Layers are split as vLLM's ``get_pp_indices`` splits ``num_hidden_layers``: evenly, with the
remainder going one layer each to the stages before the last, from the second-to-last
backwards (the last stage holds the final norm and the LM head; with few extra layers the
middle stages take them, sparing the embedding stage too). ``partition`` overrides the split
with explicit per-stage layer counts, as ``VLLM_PP_LAYER_PARTITION`` does. Layer indices
count every decoder layer, including those that hold no cache (Nemotron-H's MLP layers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvspec_core.errors import CapacityError, ConfigError
from kvspec_core.models.encoder_decoder import is_encoder_decoder
from kvspec_core.models.layer_typing import num_layers

if TYPE_CHECKING:
    from kvspec_core.models.planning import ModelPlan, PreparedModel
    from kvspec_core.plugins.manager import PluginManager


def stage_layer_counts(
    total_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> list[int]:
    """Layers per stage: ``partition`` when given (checked), else vLLM's even split."""
    if partition is not None:
        counts = list(partition)
        if len(counts) != pp_size or any(count < 1 for count in counts):
            raise ConfigError(
                f"the pipeline partition {','.join(map(str, counts))} must give {pp_size} "
                f"positive layer counts, one per stage (--pp {pp_size})"
            )
        if sum(counts) != total_layers:
            raise ConfigError(
                f"the pipeline partition {','.join(map(str, counts))} covers {sum(counts)} "
                f"layers but the model has {total_layers}; the counts must add up to "
                f"{total_layers}"
            )
        return counts
    if pp_size > total_layers:
        raise ConfigError(
            f"--pp {pp_size} exceeds the model's {total_layers} layers; every pipeline stage "
            f"needs at least one layer: use --pp {total_layers} or fewer"
        )
    counts = [total_layers // pp_size] * pp_size
    for stage in range(2, total_layers % pp_size + 2):
        counts[-stage] += 1
    return counts


def stage_ranges(
    total_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """``[start, end)`` layer indices of each stage."""
    ranges: list[tuple[int, int]] = []
    start = 0
    for count in stage_layer_counts(total_layers, pp_size, partition):
        ranges.append((start, start + count))
        start += count
    return ranges


@attrs.frozen(kw_only=True, eq=False)
class PreparedStage:
    """One pipeline stage ready to plan: its layer range and its part of the model."""

    stage: int
    layer_range: tuple[int, int]
    prepared: PreparedModel


@attrs.frozen(kw_only=True, eq=False)
class StagePlan:
    """One pipeline stage planned at the per-GPU budget."""

    stage: int
    layer_range: tuple[int, int]
    result: ModelPlan


@attrs.frozen(kw_only=True, eq=False)
class PipelinePlan:
    """Every stage's plan; the model's concurrency is the least over the stages."""

    stages: tuple[StagePlan, ...]

    @property
    def bottleneck(self) -> StagePlan:
        """The stage that admits the fewest max-length requests (the first on a tie)."""
        return min(self.stages, key=lambda stage: stage.result.plan.max_concurrency)

    @property
    def max_concurrency(self) -> float:
        """Requests of ``max_model_len`` tokens every stage can hold at once."""
        return self.bottleneck.result.plan.max_concurrency


def split_stages(
    prepared: PreparedModel, pp_size: int, partition: Sequence[int] | None = None
) -> list[PreparedStage]:
    """``prepared`` cut into ``pp_size`` stages; a stage whose layers hold no cache (only
    MLP layers) is left out, since it bounds nothing."""
    model = prepared.model
    if is_encoder_decoder(model.config):
        if pp_size > 1 or partition is not None:
            raise ConfigError(
                f"model {model.name} is an encoder-decoder model; pipeline parallelism (--pp) "
                "is planned for decoder-only models. Use --pp 1"
            )
        total = max(layer.index for layer in model.layers) + 1
    else:
        total = num_layers(model.config)
    stages: list[PreparedStage] = []
    for stage, (start, end) in enumerate(stage_ranges(total, pp_size, partition)):
        layers = tuple(layer for layer in model.layers if start <= layer.index < end)
        if not layers:
            continue
        names = {layer.name for layer in layers}
        part = attrs.evolve(
            prepared,
            model=attrs.evolve(model, layers=layers),
            specs={name: spec for name, spec in prepared.specs.items() if name in names},
        )
        stages.append(PreparedStage(stage=stage, layer_range=(start, end), prepared=part))
    return stages


def plan_stages(
    stages: Sequence[PreparedStage], budget_bytes: int, manager: PluginManager
) -> PipelinePlan:
    """Plan every stage within ``budget_bytes`` (one GPU each). When a stage cannot hold one
    request, the :class:`CapacityError` names the stage and the largest max model length
    every stage fits."""
    plans: list[StagePlan] = []
    for stage in stages:
        try:
            result = stage.prepared.plan(budget_bytes, manager)
        except CapacityError as error:
            if len(stages) == 1:
                raise
            start, end = stage.layer_range
            raise CapacityError(
                f"pipeline stage {stage.stage} (layers {start}..{end - 1}): {error}"
            ) from None
        plans.append(StagePlan(stage=stage.stage, layer_range=stage.layer_range, result=result))
    return PipelinePlan(stages=tuple(plans))


def largest_fitting_max_model_len(
    stages: Sequence[PreparedStage], budget_bytes: int, manager: PluginManager
) -> int:
    """The largest max model length one request of which fits every stage (0: none)."""
    return min(
        stage.prepared.largest_fitting_max_model_len(budget_bytes, manager) for stage in stages
    )
