"""Reference figures at 40 GiB, block 16, 16,384 in-flight tokens (DESIGN.md table)."""

from __future__ import annotations

import pytest
from planner_testkit import (
    GiB,
    StateSpec,
    assert_views_sound,
    gemma_2_9b,
    gpt_oss_20b,
    jamba_1_5_mini,
    llama_3_1_8b,
    llama_4_scout,
    manager_with_test_kinds,
    mistral_7b,
    nemotron_h_56b,
    qwen3_next_80b,
    vllm_inflated_concurrency,
)

from kvspec_core import SizingContext
from kvspec_core.planner import plan_kv_cache


def test_llama_3_1_8b_matches_the_single_pool_figure() -> None:
    plan = plan_kv_cache(
        llama_3_1_8b(), 40 * GiB, SizingContext(max_model_len=131072), manager_with_test_kinds()
    )
    assert len(plan.groups) == 1 and len(plan.pools) == 1
    assert plan.pools[0].block_bytes == 2 * (1 << 20)
    assert plan.num_blocks == 20480
    assert plan.groups[0].blocks_per_request == 8192
    assert plan.max_concurrency == (20480 - 1) / 8192
    assert f"{plan.max_concurrency:.2f}" == "2.50"
    assert plan.bytes_allocated == 40 * GiB and plan.bytes_padding == 0
    assert len(plan.tensors) == 1 and len(plan.tensors[0].layers) == 32


@pytest.mark.parametrize(
    ("model", "max_model_len", "expected", "groups"),
    [
        (gpt_oss_20b, 131072, "11.84", [12, 12]),
        (llama_4_scout, 262144, "2.60", [12, 12, 12, 12]),
        (mistral_7b, 32768, "15.99", [32]),
        (gemma_2_9b, 8192, "15.22", [21, 21]),
    ],
)
def test_attention_hybrids_reproduce_vllm(model, max_model_len, expected, groups) -> None:
    plan = plan_kv_cache(
        model(), 40 * GiB, SizingContext(max_model_len=max_model_len), manager_with_test_kinds()
    )
    assert f"{plan.max_concurrency:.2f}" == expected
    assert [len(group.layers) for group in plan.groups] == groups
    # One page-size class: every group shares one pool, block size untouched.
    assert len(plan.pools) == 1
    assert {group.block_size for group in plan.groups} == {16}
    if len(groups) > 1:
        assert plan.aliases == ((0, tuple(range(len(groups)))),)


@pytest.mark.parametrize(
    ("model", "max_model_len", "vllm_block", "vllm_figure"),
    [
        (jamba_1_5_mini, 262144, 80, "9.96"),
        (qwen3_next_80b, 262144, 544, "6.58"),
        (nemotron_h_56b, 8192, 4128, "18.14"),
    ],
)
def test_state_hybrids_beat_block_inflation(model, max_model_len, vllm_block, vllm_figure) -> None:
    ctx = SizingContext(max_model_len=max_model_len)
    specs = model()
    block, inflated = vllm_inflated_concurrency(specs, 40 * GiB, ctx)
    # The inflation model reproduces the seed engine's table...
    assert (block, f"{inflated:.2f}") == (vllm_block, vllm_figure)
    plan = plan_kv_cache(specs, 40 * GiB, ctx, manager_with_test_kinds())
    # ...and the planner keeps block 16 and admits more requests at once.
    assert {group.block_size for group in plan.groups} == {16}
    assert plan.max_concurrency > inflated
    assert len(plan.pools) == 2
    assert plan.bytes_allocated <= 40 * GiB
    assert plan.needs_zeroing and plan.has_state_layers


def test_nemotron_state_groups_have_no_short_group() -> None:
    plan = plan_kv_cache(
        nemotron_h_56b(), 40 * GiB, SizingContext(max_model_len=8192), manager_with_test_kinds()
    )
    sizes = sorted(len(group.layers) for group in plan.groups if group.kind == "planner_test_state")
    assert sizes == [9] * 6
    # The test kinds' state spec declares no fixed blocks: sized as growing ones.
    assert f"{plan.max_concurrency:.2f}" == "19.75"


def test_real_sliding_window_and_chunked_plugins_reproduce_the_table() -> None:
    swa = pytest.importorskip("kvspec_sliding_window")
    chunked = pytest.importorskip("kvspec_chunked_local")
    import torch

    from kvspec_core import PluginManager
    from kvspec_core.specs import FullAttentionSpec

    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "sliding_window,chunked_local"})
    common = dict(block_size=16, num_kv_heads=8, head_size=64, dtype=torch.bfloat16)
    gpt = {
        f"l{i}": (
            swa.SlidingWindowSpec(sliding_window=128, **common)
            if i % 2 == 0
            else FullAttentionSpec(**common)
        )
        for i in range(24)
    }
    plan = plan_kv_cache(gpt, 40 * GiB, SizingContext(max_model_len=131072), manager)
    assert f"{plan.max_concurrency:.2f}" == "11.84"
    assert [group.kind for group in plan.groups] == ["sliding_window", "full_attention"]
    common["head_size"] = 128
    scout = {
        f"l{i}": (
            FullAttentionSpec(**common)
            if i % 4 == 3
            else chunked.ChunkedLocalAttentionSpec(attention_chunk_size=8192, **common)
        )
        for i in range(48)
    }
    plan = plan_kv_cache(scout, 40 * GiB, SizingContext(max_model_len=262144), manager)
    assert f"{plan.max_concurrency:.2f}" == "2.60"
    assert len(plan.groups) == 4 and len(plan.pools) == 1


def test_real_mamba_plugin_specs_beat_inflation() -> None:
    mamba = pytest.importorskip("kvspec_mamba")
    import torch

    from kvspec_core import PluginManager
    from kvspec_core.specs import FullAttentionSpec

    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "mamba"})
    # Nemotron-H-56B: Mamba-2 conv (3, 16384 + 2*8*256) bf16 + ssm (256, 64, 256) fp32.
    state = mamba.MambaSpec(
        block_size=16, shapes=((3, 20480), (256, 64, 256)), dtypes=(torch.bfloat16, torch.float32)
    )
    attention = FullAttentionSpec(
        block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    ours = {
        name: (state if isinstance(spec, StateSpec) else attention)
        for name, spec in nemotron_h_56b().items()
    }
    ctx = SizingContext(max_model_len=8192, mamba_cache_mode="align")
    plan = plan_kv_cache(ours, 40 * GiB, ctx, manager)
    # vLLM's inflated block gives 18.14. The states are sized for 19 whole requests; what is
    # left would hold 0.75 more of attention, but not a 20th request's states (19.75 before:
    # that fraction could never run).
    assert f"{plan.max_concurrency:.2f}" == "19.00"
    assert {group.kind for group in plan.groups} == {"mamba", "full_attention"}
    assert plan.needs_zeroing


def test_real_mamba_views_are_sound_on_every_layout() -> None:
    mamba = pytest.importorskip("kvspec_mamba")
    import torch

    from kvspec_core import PluginManager
    from kvspec_core.planner import LAYOUTS
    from kvspec_core.specs import FullAttentionSpec

    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "mamba"})
    state = mamba.MambaSpec(
        block_size=4, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32)
    )
    attention = FullAttentionSpec(block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float16)
    specs = {f"l{i}": (attention if i % 3 == 0 else state) for i in range(6)}
    for layout in LAYOUTS:
        plan = plan_kv_cache(
            specs, 32 << 10, SizingContext(max_model_len=64), manager, layout=layout
        )
        assert len(plan.pools) == 2
        assert_views_sound(plan)
