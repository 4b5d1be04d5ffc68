"""Pipeline stages: layers split as vLLM's get_pp_indices splits them, each stage planned at
the per-GPU budget, the model's concurrency the least over the stages."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_testkit import preset

from kvspec_core.errors import CapacityError, ConfigError
from kvspec_core.models.pipeline import (
    plan_stages,
    split_stages,
    stage_layer_counts,
    stage_ranges,
)
from kvspec_core.models.planning import prepare_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

BUDGET = 40 << 30


# vLLM's tests/distributed/test_pipeline_partition.py goldens: (layers, pp, rank, [start, end)).
VLLM_GOLDENS = [
    (2, 2, 0, (0, 1)),
    (2, 2, 1, (1, 2)),
    (3, 2, 0, (0, 2)),
    (3, 2, 1, (2, 3)),
    (3, 3, 0, (0, 1)),
    (3, 3, 1, (1, 2)),
    (3, 3, 2, (2, 3)),
    (4, 3, 0, (0, 1)),
    (4, 3, 1, (1, 3)),
    (4, 3, 2, (3, 4)),
    (5, 3, 0, (0, 2)),
    (5, 3, 1, (2, 4)),
    (5, 3, 2, (4, 5)),
]


@pytest.mark.parametrize(("layers", "pp", "rank", "expected"), VLLM_GOLDENS)
def test_auto_split_matches_vllms_get_pp_indices(
    layers: int, pp: int, rank: int, expected: tuple[int, int]
) -> None:
    assert stage_ranges(layers, pp)[rank] == expected


def test_the_remainder_goes_to_stages_before_the_last_from_the_second_to_last_back() -> None:
    # Each checked against vLLM 0.33's get_pp_indices.
    assert stage_layer_counts(40, 3) == [13, 14, 13]
    assert stage_layer_counts(80, 3) == [27, 27, 26]
    assert stage_layer_counts(118, 3) == [39, 40, 39]
    assert stage_layer_counts(23, 4) == [6, 6, 6, 5]
    assert stage_layer_counts(32, 4) == [8, 8, 8, 8]


def test_explicit_partition_is_used_as_given() -> None:
    # vLLM's VLLM_PP_LAYER_PARTITION cases.
    assert stage_ranges(20, 4, [4, 6, 6, 4]) == [(0, 4), (4, 10), (10, 16), (16, 20)]
    assert stage_ranges(22, 4, [5, 6, 5, 6]) == [(0, 5), (5, 11), (11, 16), (16, 22)]


@pytest.mark.parametrize(
    ("layers", "pp", "partition", "message"),
    [
        (20, 4, [5, 5, 5], "must give 4 positive layer counts"),
        (21, 4, [5, 5, 5, 5], "covers 20 layers but the model has 21"),
        (20, 2, [20, 0], "must give 2 positive layer counts"),
        (3, 4, None, "--pp 4 exceeds the model's 3 layers"),
    ],
)
def test_bad_splits_are_refused(
    layers: int, pp: int, partition: list[int] | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        stage_layer_counts(layers, pp, partition)


def test_llama_70b_fits_40_gib_gpus_with_two_stages(kvspec_loaded_manager: PluginManager) -> None:
    prepared = prepare_model(preset("llama-3.1-70b"), PlanOptions(), kvspec_loaded_manager)
    with pytest.raises(CapacityError):
        plan_stages(split_stages(prepared, 1), BUDGET, kvspec_loaded_manager)
    pipeline = plan_stages(split_stages(prepared, 2), BUDGET, kvspec_loaded_manager)
    assert [s.layer_range for s in pipeline.stages] == [(0, 40), (40, 80)]
    # 40 layers x 16 tokens x 8 KV heads x (128 + 128) x 2 B per block; 8,192 blocks a request.
    block = 40 * 16 * 8 * 256 * 2
    for stage in pipeline.stages:
        assert len(stage.result.specs) == 40
        assert stage.result.plan.num_blocks == BUDGET // block == 16384
    assert pipeline.max_concurrency == pytest.approx((16384 - 1) / 8192)


def test_concurrency_is_the_least_over_uneven_stages(kvspec_loaded_manager: PluginManager) -> None:
    prepared = prepare_model(preset("llama-3.1-8b"), PlanOptions(), kvspec_loaded_manager)
    whole = plan_stages(split_stages(prepared, 1), BUDGET, kvspec_loaded_manager)
    pipeline = plan_stages(split_stages(prepared, 3, [10, 10, 12]), BUDGET, kvspec_loaded_manager)
    figures = [stage.result.plan.max_concurrency for stage in pipeline.stages]
    assert figures[0] == figures[1] > figures[2]
    assert pipeline.bottleneck.stage == 2 and pipeline.max_concurrency == figures[2]
    # 12 layers of the 32 on the tightest GPU: 32/12 of the single-GPU concurrency (blocks
    # rounded down, one null block each).
    block = 12 * 16 * 8 * 256 * 2
    assert figures[2] == pytest.approx((BUDGET // block - 1) / 8192)
    assert whole.max_concurrency == pytest.approx((20480 - 1) / 8192)


def test_a_hybrid_stage_keeps_its_own_mamba_and_attention_layers(
    kvspec_loaded_manager: PluginManager,
) -> None:
    prepared = prepare_model(preset("jamba-1.5-mini"), PlanOptions(), kvspec_loaded_manager)
    pipeline = plan_stages(split_stages(prepared, 2), BUDGET, kvspec_loaded_manager)
    for stage, (start, end) in zip(pipeline.stages, [(0, 16), (16, 32)], strict=True):
        kinds = [spec.kind for spec in stage.result.specs.values()]
        # Jamba's attention layers are 4, 12, 20, 28 (period 8, offset 4).
        assert kinds.count("full_attention") == 2 and kinds.count("mamba") == 14
        assert all(start <= layer.index < end for layer in stage.result.model.layers)


def test_stages_without_cache_layers_bound_nothing(kvspec_loaded_manager: PluginManager) -> None:
    config = preset("nemotron-h-56b")
    pattern = config["hybrid_override_pattern"]
    assert pattern.startswith("M-")  # layer 1 is MLP only: no cache
    prepared = prepare_model(config, PlanOptions(), kvspec_loaded_manager)
    stages = split_stages(prepared, 3, [1, 1, len(pattern) - 2])
    assert [stage.stage for stage in stages] == [0, 2]
    pipeline = plan_stages(stages, BUDGET, kvspec_loaded_manager)
    assert pipeline.max_concurrency == min(s.result.plan.max_concurrency for s in pipeline.stages)


def test_encoder_decoder_models_are_refused_above_one_stage(
    kvspec_loaded_manager: PluginManager,
) -> None:
    prepared = prepare_model(preset("whisper-large-v3"), PlanOptions(), kvspec_loaded_manager)
    assert len(split_stages(prepared, 1)) == 1
    with pytest.raises(ConfigError, match="encoder-decoder"):
        split_stages(prepared, 2)


@given(layers=st.integers(1, 2000), pp=st.integers(1, 64))
def test_stages_cover_every_layer_once_and_differ_by_at_most_one(layers: int, pp: int) -> None:
    if pp > layers:
        with pytest.raises(ConfigError):
            stage_ranges(layers, pp)
        return
    ranges = stage_ranges(layers, pp)
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in pairwise(ranges))
    sizes = [end - start for start, end in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    # The last stage never takes an extra layer (it holds the final norm and LM head).
    assert sizes[-1] == layers // pp
