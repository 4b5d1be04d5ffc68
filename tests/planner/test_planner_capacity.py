"""Capacity: refusing budgets too small for one request, and the largest length that fits."""

from __future__ import annotations

import pytest
from planner_testkit import (
    GiB,
    StateSpec,
    full,
    layers,
    llama_3_1_8b,
    manager_with_test_kinds,
    mistral_7b,
)

from kvspec_core import CapacityError, SizingContext
from kvspec_core.planner import largest_fitting_max_model_len, plan_kv_cache
from kvspec_core.validation import MAX_FIELD_VALUE


def test_llama_70b_shape_is_refused_naming_bytes_and_the_largest_length() -> None:
    specs = layers([full() for _ in range(80)])  # 80 layers x 8 KV heads x 128, bf16
    with pytest.raises(CapacityError) as caught:
        plan_kv_cache(
            specs, 40 * GiB, SizingContext(max_model_len=131072), manager_with_test_kinds()
        )
    message = str(caught.value)
    page = 80 * 16 * 8 * 256 * 2
    assert f"needs {(8192 + 1) * page} bytes" in message
    assert f"is {40 * GiB} bytes" in message
    assert "max_model_len=131072" in message
    # (cdiv(len, 16) + 1) blocks of 5 MiB must fit in 40 GiB: at most 8191 blocks of 16.
    assert "largest max_model_len that fits is 131056" in message


def test_largest_fitting_length_fits_and_one_more_token_does_not() -> None:
    manager = manager_with_test_kinds()
    ctx = SizingContext(max_model_len=131072)
    largest = largest_fitting_max_model_len(llama_3_1_8b(), 40 * GiB, ctx, manager)
    assert largest == (20480 - 1) * 16
    plan = plan_kv_cache(llama_3_1_8b(), 40 * GiB, SizingContext(max_model_len=largest), manager)
    assert plan.max_concurrency == 1.0
    with pytest.raises(CapacityError):
        plan_kv_cache(llama_3_1_8b(), 40 * GiB, SizingContext(max_model_len=largest + 1), manager)


def test_largest_fitting_length_is_zero_when_nothing_fits() -> None:
    assert (
        largest_fitting_max_model_len(
            llama_3_1_8b(), 1 << 20, SizingContext(max_model_len=16), manager_with_test_kinds()
        )
        == 0
    )
    with pytest.raises(CapacityError, match="no max_model_len fits"):
        plan_kv_cache(
            llama_3_1_8b(), 1 << 20, SizingContext(max_model_len=16), manager_with_test_kinds()
        )


def test_bounded_families_fit_every_length() -> None:
    # Sliding windows stop growing: every length fits once the window does.
    manager = manager_with_test_kinds()
    assert (
        largest_fitting_max_model_len(
            mistral_7b(), 40 * GiB, SizingContext(max_model_len=8), manager
        )
        == MAX_FIELD_VALUE
    )
    assert (
        largest_fitting_max_model_len(
            mistral_7b(), 40 * GiB, SizingContext(max_model_len=8), manager, upper=1 << 20
        )
        == 1 << 20
    )


def test_state_pool_blocks_count_in_capacity() -> None:
    # A hybrid needs its state blocks and both null blocks too.
    state = StateSpec(block_size=16, state_bytes=1 << 20)
    specs = layers([full(), state])
    page = 16 * 8 * 256 * 2
    need = (4096 // 16 + 1) * page + (2 + 1) * (1 << 20)
    plan = plan_kv_cache(specs, need, SizingContext(max_model_len=4096), manager_with_test_kinds())
    assert plan.max_concurrency == 1.0 and plan.bytes_padding == 0
    with pytest.raises(CapacityError, match=f"needs {need} bytes"):
        plan_kv_cache(specs, need - 1, SizingContext(max_model_len=4096), manager_with_test_kinds())
