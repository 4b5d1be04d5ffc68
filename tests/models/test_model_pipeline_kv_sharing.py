"""Pipeline stages and cross-layer KV sharing: a reader is never split from its source, and a
stage holding no cache is never the bottleneck."""

from __future__ import annotations

import re

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvspec_core.errors import ConfigError
from kvspec_core.models.pipeline import (
    plan_stages,
    split_stages,
    stage_ranges,
    suggest_partition,
)
from kvspec_core.models.planning import PreparedModel, prepare_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.specs import EncoderOnlyAttentionSpec

BUDGET = 40 << 30
#: transformers' Gemma3nTextConfig defaults (Gemma-3n-E4B's text model): 35 layers, the
#: last 15 reading layer 18 (sliding) or 19 (full).
GEMMA_3N = {"model_type": "gemma3n_text"}


def _prepared(manager: PluginManager) -> PreparedModel:
    return prepare_model(GEMMA_3N, PlanOptions(), manager, name="gemma-3n")


def test_two_stages_keep_every_reader_with_its_source(
    kvspec_loaded_manager: PluginManager,
) -> None:
    """vLLM's split (18, 17) puts layers 18..34, the two sources and all 15 readers, on
    stage 1: it plans, and stage 1 holds blocks for layers 18 and 19 only."""
    pipeline = plan_stages(
        split_stages(_prepared(kvspec_loaded_manager), 2), BUDGET, kvspec_loaded_manager
    )
    first, second = pipeline.stages
    assert second.layer_range == (18, 35)
    held = {layer for group in second.result.plan.groups for layer in group.layers}
    assert held == {"model.layers.18", "model.layers.19"}
    assert len(second.result.plan.kv_sharing) == 15
    assert pipeline.bottleneck is first


def test_a_split_between_a_reader_and_its_source_is_refused_with_a_partition(
    kvspec_loaded_manager: PluginManager,
) -> None:
    prepared = _prepared(kvspec_loaded_manager)
    with pytest.raises(ConfigError) as caught:
        split_stages(prepared, 3)  # (12, 12, 11): layers 24..34 read 18/19 on stage 1
    message = str(caught.value)
    assert "--pp 3 puts layer model.layers.24 on pipeline stage 2" in message
    assert "model.layers.19, on stage 1" in message
    assert "a stage cannot read a cache held on another GPU" in message
    assert "use --pp-partition 12,6,17" in message
    stages = split_stages(prepared, 3, [12, 6, 17])
    assert [stage.layer_range for stage in stages] == [(0, 12), (12, 18), (18, 35)]
    plan_stages(stages, BUDGET, kvspec_loaded_manager)
    with pytest.raises(
        ConfigError, match=re.escape("the --pp-partition given puts layer model.layers.20")
    ):
        split_stages(prepared, 2, [20, 15])


def test_no_partition_is_suggested_where_none_exists(kvspec_loaded_manager: PluginManager) -> None:
    # Layers 18..34 must share one stage: 3 stages need a start inside 1..18 twice, and 18
    # stages cannot all start there.
    assert suggest_partition(35, 18, [(18, 34), (19, 30)]) is not None
    assert suggest_partition(35, 19, [(18, 34), (19, 30)]) is not None
    assert suggest_partition(35, 20, [(18, 34), (19, 30)]) is None
    with pytest.raises(ConfigError, match="no split into 20 stages keeps"):
        split_stages(_prepared(kvspec_loaded_manager), 20)


@given(
    st.integers(2, 40).flatmap(
        lambda total: st.tuples(
            st.just(total),
            st.integers(2, total),
            st.lists(
                st.tuples(st.integers(0, total - 2), st.integers(1, total - 1)).map(sorted),
                max_size=4,
            ),
        )
    )
)
def test_a_suggested_partition_is_valid(case: tuple[int, int, list[list[int]]]) -> None:
    total, pp, raw_pairs = case
    pairs = [(source, reader) for source, reader in raw_pairs if source < reader]
    counts = suggest_partition(total, pp, pairs)
    if counts is None:
        return
    assert len(counts) == pp and sum(counts) == total and min(counts) >= 1
    ranges = stage_ranges(total, pp, counts)
    for source, reader in pairs:
        assert [start <= source < end for start, end in ranges] == [
            start <= reader < end for start, end in ranges
        ]


def test_a_stage_holding_no_cache_is_not_the_bottleneck(
    kvspec_loaded_manager: PluginManager,
) -> None:
    """Before, a stage whose layers all need no blocks planned 0 blocks and concurrency
    0.00 and was reported as the bottleneck."""
    prepared = _prepared(kvspec_loaded_manager)
    encoder = EncoderOnlyAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=256, dtype=torch.bfloat16
    )
    memoryless_tail = {
        name: (encoder if int(name.rsplit(".", 1)[1]) >= 18 else spec)
        for name, spec in prepared.specs.items()
    }
    pipeline = plan_stages(
        split_stages(attrs.evolve(prepared, specs=memoryless_tail), 2),
        BUDGET,
        kvspec_loaded_manager,
    )
    first, second = pipeline.stages
    assert second.result.plan.pools == () and second.result.plan.max_concurrency == 0.0
    assert pipeline.bottleneck is first
    assert pipeline.max_concurrency == first.result.plan.max_concurrency > 0
