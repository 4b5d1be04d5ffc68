"""The default eviction order on multi-turn chat traffic: never fewer hit tokens than plain
LRU (vLLM's order), nor than the segmented LRU that was the default before, on full
attention, a sliding-window hybrid and a Mamba hybrid, with tight and loose pools."""

from __future__ import annotations

import pytest
from runtime_testkit import full, mamba, manager_with_families, sliding

from kvspec_core import SizingContext
from kvspec_core.runtime import KVCacheAllocator, chat_trace, simulate
from kvspec_core.runtime.pool import DEFAULT_EVICTION

#: A reduced chat trace: 150 requests, 16 at once, short think times, prompts <= 3,000.
EVENTS = list(
    chat_trace.make_trace(
        seed=1, num_requests=150, max_running=16, think_rounds=(5, 60), max_prompt_tokens=3000
    )
)
MODELS = {
    "full": lambda: [full(16)],
    "sliding_hybrid": lambda: [full(16), sliding(16, 1024)],
    "mamba_hybrid": lambda: [full(16), mamba(16)],
}
#: Tight: a little above the peak blocks in use (evictions decide the hits); loose: room.
POOLS = [
    ("full", 2600),
    ("sliding_hybrid", 3700),
    ("mamba_hybrid", 2600),
    ("full", 4096),
    ("sliding_hybrid", 4096),
    ("mamba_hybrid", 4096),
]


def _hit_tokens(model: str, num_blocks: int, eviction: str | None) -> int:
    options = {} if eviction is None else {"eviction": eviction}
    allocator = KVCacheAllocator(
        MODELS[model](),
        num_blocks,
        SizingContext(max_model_len=4096, mamba_cache_mode="align"),
        manager=manager_with_families(),
        hash_salt=b"chat",
        **options,
    )
    report = simulate(allocator, EVENTS)
    allocator.check_invariants()
    return report.hit_tokens


@pytest.mark.parametrize(("model", "num_blocks"), POOLS)
def test_default_eviction_hits_at_least_lru_and_segmented_on_chat(
    model: str, num_blocks: int
) -> None:
    default = _hit_tokens(model, num_blocks, None)
    assert default >= _hit_tokens(model, num_blocks, "lru")
    assert default >= _hit_tokens(model, num_blocks, "segmented")


def test_default_eviction_reaches_the_chat_traces_ideal_with_room() -> None:
    # Full attention with room for every block: only the last prompt token and partial
    # blocks are recomputed, so the hits equal the trace's ideal at 16-token blocks.
    ideal = chat_trace.trace_stats(EVENTS, block_sizes=(16,))["ideal_reusable_at_block_16"]
    assert ideal > 100_000
    assert _hit_tokens("full", 8192, None) == ideal
    assert DEFAULT_EVICTION == "lru"


def test_chat_trace_copy_matches_the_shared_generator_digest() -> None:
    # The in-package copy must keep yielding the shared generator's events (checked
    # against shared/bench/chat_trace.py when it was copied: seed 3, 200 requests).
    import hashlib

    events = list(chat_trace.make_trace(seed=3, num_requests=200))
    assert len(events) == 54596
    assert hashlib.sha256(repr(events).encode()).hexdigest()[:16] == "06356c8b9800aef7"
