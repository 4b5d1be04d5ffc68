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
from kvspec_core.specs.kv_sharing import KVSharingSpec

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
        """The stage that admits the fewest max-length requests (the first on a tie). A
        stage whose layers hold no cache (each memoryless, or reading another layer's
        cache) admits without bound and is never the bottleneck, unless no stage holds one."""
        holding = [stage for stage in self.stages if stage.result.plan.pools]
        return min(holding or self.stages, key=lambda stage: stage.result.plan.max_concurrency)

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
    ranges = stage_ranges(total, pp_size, partition)
    check_sharing_within_stages(prepared, ranges, partition is not None)
    stages: list[PreparedStage] = []
    for stage, (start, end) in enumerate(ranges):
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


def _stage_of(ranges: Sequence[tuple[int, int]], index: int) -> int:
    return next(stage for stage, (start, end) in enumerate(ranges) if start <= index < end)


def check_sharing_within_stages(
    prepared: PreparedModel, ranges: Sequence[tuple[int, int]], partitioned: bool
) -> None:
    """Refuse stages that split a layer from the layer whose KV cache it reads: a stage
    cannot view another GPU's memory, and giving the reader a copy would need the engine to
    send the source's cache between stages every step, which no engine does (vLLM refuses
    such a target too). The error names the first such pair and a partition that keeps
    every reader on its source's stage, when one exists."""
    index_of = {layer.name: layer.index for layer in prepared.model.layers}
    pairs = [
        (index_of[spec.target_layer], index_of[name], spec.target_layer, name)
        for name, spec in prepared.specs.items()
        if isinstance(spec, KVSharingSpec) and spec.target_layer in index_of and name in index_of
    ]
    for source, reader, source_name, reader_name in pairs:
        source_stage, reader_stage = _stage_of(ranges, source), _stage_of(ranges, reader)
        if source_stage == reader_stage:
            continue
        total = ranges[-1][1]
        suggestion = suggest_partition(total, len(ranges), [(s, r) for s, r, _, _ in pairs])
        fix = (
            f"use --pp-partition {','.join(map(str, suggestion))}, which keeps every reading "
            "layer on its source's stage"
            if suggestion is not None
            else f"no split into {len(ranges)} stages keeps every reading layer on its source's "
            "stage; use fewer stages (--pp)"
        )
        how = "the --pp-partition given" if partitioned else f"--pp {len(ranges)}"
        raise ConfigError(
            f"{how} puts layer {reader_name} on pipeline stage {reader_stage} and the layer "
            f"whose KV cache it reads (cross-layer KV sharing), {source_name}, on stage "
            f"{source_stage}; a stage cannot read a cache held on another GPU: {fix}"
        )


def suggest_partition(
    total_layers: int, pp_size: int, pairs: Sequence[tuple[int, int]]
) -> list[int] | None:
    """Layers per stage, as near vLLM's even split as a greedy choice of stage starts gets,
    such that no stage start falls in ``(source, reader]`` of any ``(source, reader)`` pair of
    layer indices; ``None`` when none is found."""
    crossing = [0] * (total_layers + 1)
    for source, reader in pairs:
        crossing[source + 1] += 1
        crossing[reader + 1] -= 1
    allowed, open_pairs = [], 0
    for start in range(1, total_layers):
        open_pairs += crossing[start]
        if not open_pairs:
            allowed.append(start)
    counts = stage_layer_counts(total_layers, pp_size) if pp_size <= total_layers else None
    if counts is None:
        return None
    wanted = [sum(counts[:stage]) for stage in range(1, pp_size)]
    chosen: list[int] = []
    for position, target in enumerate(wanted):
        later = len(wanted) - position - 1  # starts still to choose after this one
        previous = chosen[-1] if chosen else 0
        candidates = [
            start
            for number, start in enumerate(allowed)
            if start > previous and len(allowed) - number - 1 >= later
        ]
        if not candidates:
            return None
        chosen.append(min(candidates, key=lambda start: (abs(start - target), start)))
    bounds = [0, *chosen, total_layers]
    return [bounds[i + 1] - bounds[i] for i in range(pp_size)]
