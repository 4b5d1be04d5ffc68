"""The compiled block-boundary step of hybrid allocators changes nothing but speed.

An allocator whose holding groups all keep the step methods of one of the core's parametric
rule shapes (full attention, :class:`TrailingWindowRules`, :class:`StateCheckpointRules`)
has its block-boundary steps done by the kernels (``group_step.c``); with KV events on, the
same allocator runs them as Python (``_grow_checked``). Random programs drive both side by
side: every result, error, hit, block table, running state and pool field must stay equal.
"""

from __future__ import annotations

from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from runtime_testkit import (
    chunked,
    context,
    full,
    make_allocator,
    mamba,
    manager_with_families,
    sliding,
)
from test_dense_path import programs, run_on_both

from kvspec_core import SizingContext
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.runtime.native import native
from kvspec_core.runtime.pool import EVICTION_POLICIES
from kvspec_core.runtime.rules import (
    FullAttentionRules,
    StateCheckpointRules,
    TrailingWindowRules,
    compiled_shape,
)

# Tests of the kernel itself: run once, with the kernels (not also as pure Python).
pytestmark = [
    pytest.mark.both_kernels,
    pytest.mark.skipif(native is None, reason="kvspec_core.runtime._native is not built"),
]

CONFIGS: dict[str, tuple[list[Any], Any, Any]] = {
    "window + full, one pool": ([full(2), sliding(2, 5)], 30, None),
    "full + window, two pools": ([full(2), sliding(2, 3)], [16, 10], [0, 1]),
    "state + full, one pool": ([full(2), mamba(2)], 30, None),
    "state + window + full, two pools": ([full(2), mamba(2), sliding(2, 4)], [24, 14], [0, 1, 0]),
    "two full groups, two pools": ([full(2), full(2)], [16, 12], [0, 1]),
}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=st.sampled_from(sorted(CONFIGS)),
    eviction=st.sampled_from(EVICTION_POLICIES),
    caching=st.booleans(),
    program=programs,
)
def test_the_compiled_group_step_equals_the_general_one(
    config: str, eviction: str, caching: bool, program: list
) -> None:
    specs, blocks, pools = CONFIGS[config]
    options = {"eviction": eviction, "enable_prefix_caching": caching}
    compiled = make_allocator(specs, blocks, pools, **options)
    general = make_allocator(specs, blocks, pools, enable_kv_events=True, **options)
    assert compiled._compiled_group_step() is not None
    assert general._compiled_group_step() is None
    run_on_both((compiled, general), program)


@pytest.mark.parametrize(
    "specs", [[full(2), sliding(2, 5)], [full(2), mamba(2)]], ids=["window", "state"]
)
def test_block_boundary_steps_of_a_hybrid_run_compiled(specs: list[Any]) -> None:
    allocator = make_allocator(specs, 40)

    def refuse(*args: object) -> None:
        raise AssertionError("the Python step ran")

    request = Request("r", [1, 2, 3])
    assert allocator.allocate_slots(request, 3)
    allocator._grow = refuse  # type: ignore[method-assign]
    for token in range(4, 20):  # crosses block boundaries, frees window / old state blocks
        request.append_token(token)
        assert allocator.allocate_slots(request, 1)
    assert allocator.num_computed_tokens("r") == 19
    allocator.check_invariants()


def test_compiled_shape_knows_the_core_shapes_and_nothing_overridden() -> None:
    ctx = context()
    rules = [rule for rule in make_allocator([full(2), sliding(2, 5), mamba(2)], 30).rules]
    assert [compiled_shape(rule) for rule in rules] == [0, 1, 2]
    assert [type(rule).__mro__[1] for rule in rules[1:]] == [
        TrailingWindowRules,
        StateCheckpointRules,
    ]

    class Skips(FullAttentionRules):
        def skipped_tokens(self, num_computed: int) -> int:
            return num_computed // 2

    class OwnHits(TrailingWindowRules):
        def longest_hit(self, hashes, cache, max_blocks):  # type: ignore[no-untyped-def]
            return []

    assert compiled_shape(Skips(full(2), ctx)) is None
    assert compiled_shape(OwnHits(full(2), ctx)) == 1  # hits are not part of a step


def test_rules_with_their_own_step_methods_or_events_run_as_python() -> None:
    # Chunked local attention's rules are the plugin's own Python.
    assert make_allocator([full(2), chunked(2, 4)], 30)._compiled_group_step() is None
    assert (
        make_allocator([full(2), sliding(2, 5)], 30, enable_kv_events=True)._compiled_group_step()
        is None
    )
    # A group block of two hash blocks: the general path hashes between them.
    assert make_allocator([full(2), sliding(4, 5)], 30)._compiled_group_step() is None
    # Mamba outside align mode keeps its running states in Python rules.
    none_mode = SizingContext(max_model_len=64, max_in_flight_tokens=8, mamba_cache_mode="none")
    allocator = KVCacheAllocator(
        [full(2), mamba(2)], 30, none_mode, manager=manager_with_families()
    )
    assert allocator._compiled_group_step() is None
