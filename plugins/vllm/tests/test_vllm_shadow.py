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
from kvspec_vllm import shadow, shadow_differences

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


#: Blocks that put each sliding-window model under memory pressure (requests wait, Gemma's
#: are preempted and resumed with their output tokens).
PRESSURE_BLOCKS = {"mistral-7b": 24, "gemma-2-9b": 40}


@pytest.mark.parametrize(
    ("preset", "reasons"),
    [
        ("mistral-7b", {shadow_differences.COPIES}),
        ("gemma-2-9b", {shadow_differences.COPIES, shadow_differences.NOT_RETAINED}),
    ],
)
def test_sliding_window_differences_under_pressure_are_expected(
    checkpoints: dict[str, Path], shadowed: None, preset: str, reasons: set[str]
) -> None:
    """The differences these runs find (Mistral: free blocks; Gemma 2: also resumed requests'
    hits) all have an expected reason; none is a divergence."""
    report = shadow_run(checkpoints[preset], num_gpu_blocks_override=PRESSURE_BLOCKS[preset]).report
    assert report.differences == []
    assert report.agrees and not report.identical
    assert reasons <= set(report.expected_reasons) <= set(shadow_differences.EXPECTED_REASONS)
    assert report.equal_hits > 0 and report.equal_free_blocks > 0


def test_kvspecs_longer_resume_hit_gives_the_same_tokens(
    checkpoints: dict[str, Path], shadowed: None
) -> None:
    """Gemma 2 under pressure: kvspec resumes preempted 129-token requests at 128 tokens where
    vLLM's default retention resumes them at 96. With dense retention vLLM itself takes the
    128-token hit (the same sliding-window blocks 2 and 3, full-attention blocks 0-3), and
    every generated token is the same: the K/V kvspec's hit reuses is what the model
    computes."""
    outputs = {}
    resumed_hits: dict[str, set[tuple[int, int, int]]] = {}
    for name, retention in (("sparse", 0), ("dense", None)):
        seen: set[tuple[int, int, int]] = set()

        def record(attached: shadow.KVCacheShadow, seen: set = seen) -> None:
            looked_up = attached.looked_up

            def recording(request: Any, vllm_hit_tokens: int) -> None:
                looked_up(request, vllm_hit_tokens)
                if request.num_preemptions:
                    prefix = attached._prefixes.get(request.request_id)
                    kvspec_hit = prefix.num_tokens if prefix is not None else -1
                    seen.add((request.num_tokens, vllm_hit_tokens, kvspec_hit))

            attached.looked_up = recording  # type: ignore[method-assign]

        count = len(shadow.shadows())
        with vllm_engines.engine(
            checkpoints["gemma-2-9b"],
            num_gpu_blocks_override=PRESSURE_BLOCKS["gemma-2-9b"],
            prefix_cache_retention_interval=retention,
        ) as llm:
            (attached,) = shadow.shadows()[count:]
            record(attached)
            outputs[name] = [
                [tuple(out.outputs[0].token_ids) for out in vllm_engines.generate(llm, batch(), 40)]
                for _ in range(2)
            ]
        resumed_hits[name] = seen
    assert outputs["sparse"] == outputs["dense"]
    assert (129, 96, 128) in resumed_hits["sparse"]
    assert (129, 128, 128) in resumed_hits["dense"]


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
