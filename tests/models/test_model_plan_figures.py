"""Whole-model plans pinned to hand-computed facts and to the DESIGN.md table (vLLM at 40 GiB,
block 16, prefix caching on, 16,384 in-flight tokens)."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest
from model_testkit import preset

from kvspec_core.arithmetic import cdiv
from kvspec_core.context import SizingContext
from kvspec_core.errors import CapacityError
from kvspec_core.models.catalog import preset_names
from kvspec_core.models.planning import plan_model, prepare_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

GIB = 1 << 30
BUDGET = 40 * GIB


def prepared(name: str, manager: PluginManager, **kwargs: object):
    return prepare_model(preset(name), PlanOptions(), manager, name=name, **kwargs)


def per_token_bytes(specs) -> Fraction:
    """Bytes one more token costs across layers that keep every token (page / block)."""
    return sum((Fraction(s.page_size_bytes, s.block_size) for s in specs), Fraction(0))


def test_every_preset_plans_at_40_gib_or_names_the_largest_length(
    kvspec_loaded_manager: PluginManager,
) -> None:
    for name in preset_names():
        model = prepared(name, kvspec_loaded_manager)
        try:
            result = model.plan(BUDGET, kvspec_loaded_manager)
        except CapacityError as error:
            largest = int(re.search(r"largest max_model_len that fits is (\d+)", str(error))[1])
            assert largest == model.largest_fitting_max_model_len(BUDGET, kvspec_loaded_manager)
            fits = prepared(name, kvspec_loaded_manager, max_model_len=largest)
            assert fits.plan(BUDGET, kvspec_loaded_manager).plan.max_concurrency >= 1
            with pytest.raises(CapacityError):
                prepared(name, kvspec_loaded_manager, max_model_len=largest + 1).plan(
                    BUDGET, kvspec_loaded_manager
                )
            continue
        assert result.plan.max_concurrency >= 1, name
        assert result.plan.bytes_allocated <= BUDGET, name


def test_llama_70b_does_not_fit_131072_and_the_error_names_131056(
    kvspec_loaded_manager: PluginManager,
) -> None:
    # 80 layers × 8 heads × 256 × 2 B = 327,680 B per token; a 16-token block is 5 MiB and
    # 40 GiB holds 8192 blocks: 8191 usable after the null block, 8191 × 16 = 131,056 tokens.
    with pytest.raises(CapacityError, match="largest max_model_len that fits is 131056"):
        plan_model(preset("llama-3.1-70b"), BUDGET, PlanOptions(), kvspec_loaded_manager)


def test_llama_8b_bf16_costs_131072_bytes_per_token(kvspec_loaded_manager: PluginManager) -> None:
    model = prepared("llama-3.1-8b", kvspec_loaded_manager)
    assert per_token_bytes(model.specs.values()) == 131072  # 32 × 8 × (128 + 128) × 2
    result = model.plan(BUDGET, kvspec_loaded_manager)
    assert result.kv_bytes_per_token == 131072.0
    assert result.kv_bytes_per_request == 131072 * 131072


def test_deepseek_v2_lite_mla_is_576_values_per_layer(kvspec_loaded_manager: PluginManager) -> None:
    model = prepared("deepseek-v2-lite", kvspec_loaded_manager)
    assert len(model.specs) == 27
    assert per_token_bytes(model.specs.values()) == 576 * 2 * 27
    result = model.plan(BUDGET, kvspec_loaded_manager)
    assert result.kv_bytes_per_token == 576 * 2 * 27


def test_gpt_oss_sliding_layers_hold_at_most_window_plus_in_flight(
    kvspec_loaded_manager: PluginManager,
) -> None:
    model = prepared("gpt-oss-20b", kvspec_loaded_manager)
    sliding = [spec for spec in model.specs.values() if spec.kind == "sliding_window"]
    assert len(sliding) == 12
    window, in_flight, block = 128, 16384, 16
    for max_len in (131072, 1 << 20):
        ctx = SizingContext(max_model_len=max_len, max_in_flight_tokens=in_flight)
        for spec in sliding:
            blocks = spec.max_blocks_per_request(ctx)
            # DESIGN: cdiv(min(window - 1 + in_flight, max_len), block) + 1 = 1033 blocks.
            assert blocks == cdiv(min(window - 1 + in_flight, max_len), block) + 1 == 1033
            # One extra block for a window straddling a block boundary, no more.
            assert (blocks - 1) * block <= window + in_flight
    full = [spec for spec in model.specs.values() if spec.kind == "full_attention"]
    assert full[0].max_blocks_per_request(SizingContext(max_model_len=131072)) == 8192


def test_jamba_mamba_layers_hold_a_constant_state(kvspec_loaded_manager: PluginManager) -> None:
    model = prepared("jamba-1.5-mini", kvspec_loaded_manager)
    mamba = [spec for spec in model.specs.values() if spec.kind == "mamba"]
    assert len(mamba) == 28
    # conv (d_conv - 1, expand × hidden) + ssm (expand × hidden, d_state) in bf16.
    assert {spec.page_size_bytes for spec in mamba} == {(3 * 8192 + 8192 * 16) * 2} == {311296}
    usage = {
        spec.max_memory_usage_bytes(SizingContext(max_model_len=length, mamba_cache_mode="align"))
        for spec in mamba
        for length in (4096, 262144, 1 << 22)
    }
    assert usage == {2 * 311296}  # align mode: 2 states per request, whatever the length


#: Pure page arithmetic from DESIGN.md: (max model len, blocks incl. the null block, blocks
#: one max-length request needs, the table's concurrency). Blocks = 40 GiB // (page bytes of
#: one block across all layers); concurrency = (blocks - 1) / blocks per request.
PAGE_ARITHMETIC = {
    # 32 layers × 8 × 256 × 2 B × 16 = 2 MiB per block; 131072 / 16 blocks per request.
    "llama-3.1-8b": (131072, 20480, 8192, 2.50),
    # 36 layers × 8 × 256 × 2 × 16 = 2,359,296 B; 40960 / 16.
    "qwen3-8b": (40960, 18204, 2560, 7.11),
    # Sliding 4096: cdiv(min(4095 + 16384, 32768), 16) + 1.
    "mistral-7b": (32768, 20480, 1281, 15.99),
    # 32 × 32 heads × 192 × 2 × 16 = 6 MiB; sliding 2047: cdiv(min(2046 + 16384, 4096), 16) + 1.
    "phi-3-mini": (4096, 6826, 257, 26.56),
    # Two groups of 21 layers sharing one pool: 512 (full) + 513 (sliding) blocks.
    "gemma-2-9b": (8192, 15603, 1025, 15.22),
    # Two groups of 12: 8192 (full) + cdiv(127 + 16384, 16) + 1 = 1033 (sliding, window 128).
    "gpt-oss-20b": (131072, 109226, 9225, 11.84),
    # 27 layers × 576 × 2 B × 16 = 497,664 B per block; 163840 / 16.
    "deepseek-v2-lite": (163840, 86302, 10240, 8.43),
    # 4 groups of 12 layers: 16384 (global) + 3 × cdiv(min(8192 + 16384, L), 16) = 20992.
    "llama-4-scout": (262144, 54613, 20992, 2.60),
}


@pytest.mark.parametrize("name", sorted(PAGE_ARITHMETIC))
def test_design_table_pure_page_arithmetic(name: str, kvspec_loaded_manager: PluginManager) -> None:
    max_len, blocks, per_request, table = PAGE_ARITHMETIC[name]
    result = plan_model(
        preset(name), BUDGET, PlanOptions(), kvspec_loaded_manager, name=name, max_model_len=max_len
    )
    plan = result.plan
    assert plan.num_blocks == blocks
    assert [pool.blocks_per_request for pool in plan.pools] == [per_request]
    assert plan.max_concurrency == pytest.approx((blocks - 1) / per_request, rel=1e-12)
    assert round(plan.max_concurrency, 2) == table
    assert all(group.block_size == 16 for group in plan.groups)


#: vLLM's hybrid figures, exactly: it inflates the attention block (Jamba 80, Qwen3-Next 544,
#: Nemotron-H 4128 tokens) and reports num_blocks / blocks per request, the null block counted.
#: Jamba: 40 GiB // (4 × 327,680) = 32768 blocks; cdiv(262144, 80) + 7 groups × 2 = 3291.
#: Qwen3-Next: 40 GiB // (12 × 1,114,112) = 3212; cdiv(262144, 544) + 3 × 2 = 488.
#: Nemotron-H: 40 GiB // (10 × 16,908,288) = 254; cdiv(8192, 4128) + 6 × 2 = 14.
#: name -> (max len, vLLM's blocks, its state blocks per request, blocks per request, table).
VLLM_HYBRIDS = {
    "jamba-1.5-mini": (262144, 32768, 14, 3291, 9.96),
    "qwen3-next-80b": (262144, 3212, 6, 488, 6.58),
    "nemotron-h-56b": (8192, 254, 12, 14, 18.14),
}


def whole_states(blocks: int, states: int, per_request: int) -> Fraction:
    """vLLM's blocks counted as kvspec counts its own: a request begun holds all its states,
    so the fraction of a request beyond the whole ones gets attention only after them."""
    whole = blocks // per_request
    left = blocks - whole * per_request - states
    return whole + max(Fraction(0), Fraction(left, per_request - states))


@pytest.mark.parametrize("name", sorted(VLLM_HYBRIDS))
def test_hybrids_reach_at_least_vllms_concurrency_without_inflating_blocks(
    name: str,
    kvspec_loaded_manager: PluginManager,
) -> None:
    max_len, blocks, states, per_request, table = VLLM_HYBRIDS[name]
    assert round(blocks / per_request, 2) == table  # what vLLM reports
    result = plan_model(preset(name), BUDGET, PlanOptions(), kvspec_loaded_manager, name=name)
    assert result.context.max_model_len == max_len
    # Qwen3-Next: 6.5787 against vLLM's 6.5768 counted the same way (6.5820 as it reports).
    assert result.plan.max_concurrency >= whole_states(blocks, states, per_request)
    assert {group.block_size for group in result.plan.groups} == {16}
    assert result.plan.bytes_allocated <= BUDGET


@pytest.mark.parametrize("name", ["qwen3-next-80b", "jamba-1.5-mini"])
def test_the_allocator_holds_the_concurrency_the_plan_reports(
    name: str, kvspec_loaded_manager: PluginManager
) -> None:
    """Requests of max_model_len through the plan's own allocator, then one more as far as
    it gets: together they hold exactly max_concurrency x max_model_len tokens. Found in
    review: Qwen3-Next's state pool held 6 requests' states and 4 spare blocks, so the 7th
    stopped at 16,384 tokens while the plan said 6.58 (its attention for 0.58 idled)."""
    from kvspec_core.runtime import KVCacheAllocator, Request

    result = plan_model(preset(name), BUDGET, PlanOptions(), kvspec_loaded_manager, name=name)
    length, step = result.context.max_model_len, result.context.max_in_flight_tokens
    allocator = KVCacheAllocator.from_plan(result.plan, kvspec_loaded_manager, result.context)
    held = 0
    for index in range(int(result.plan.max_concurrency) + 1):
        request = Request(index, [index * 7919 + i % 30000 + 1 for i in range(length)])
        got = 0
        while got < length and allocator.allocate_slots(request, min(step, length - got)):
            got += min(step, length - got)
        while got < length and allocator.allocate_slots(request, 16):  # the last blocks
            got += 16
        held += got
    assert held == pytest.approx(result.plan.max_concurrency * length, abs=16)
