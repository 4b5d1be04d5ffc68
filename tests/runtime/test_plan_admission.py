"""The plan and the allocator agree (vLLM #40946: startup sizing and admission drifted apart).

A plan built for N max-length requests admits floor(N) of them at runtime, each prefilled in
steps of ``max_in_flight_tokens``. When every group keeps what it allocates (full attention,
Mamba's fixed states) that is exact: one more is refused. Window families (sliding window,
chunked local) free blocks once a prefill step is done, so their caps are peaks and more
requests may fit afterwards; there only the guarantee is checked."""

from __future__ import annotations

import math

import pytest

from kvspec_core import load_plugins
from kvspec_core.models.catalog import load_preset
from kvspec_core.models.planning import plan_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.runtime import NO_FREE_BLOCKS, KVCacheAllocator, NotNow, Request

MAX_LEN = 32768
GiB = 1 << 30


def admit_full_length(allocator: KVCacheAllocator, request_id: int, chunk: int) -> NotNow | None:
    """Prefill one max-length request in chunks; the first "not now", if any."""
    request = Request(request_id, [request_id % 50_000] * MAX_LEN)
    done = 0
    while done < MAX_LEN:
        step = min(chunk, MAX_LEN - done)
        result = allocator.allocate_slots(request, step)
        if not result:
            return result  # type: ignore[return-value]
        done += step
    return None


@pytest.mark.parametrize(
    ("model", "budget", "exact"),
    [
        ("llama-3.1-8b", 18 * GiB, True),
        ("jamba-1.5-mini", 10 * GiB, True),
        ("qwen3-next-80b", 12 * GiB, True),
        ("gemma-2-9b", 12 * GiB, False),
        ("llama-4-scout", 30 * GiB, False),
    ],
)
def test_plan_admits_its_max_concurrency(model: str, budget: int, exact: bool) -> None:
    manager = load_plugins()
    planned = plan_model(
        load_preset(model),
        budget,
        PlanOptions(block_size=16),
        manager,
        name=model,
        max_model_len=MAX_LEN,
    )
    allocator = KVCacheAllocator.from_plan(planned.plan, manager, enable_prefix_caching=False)
    fits = math.floor(planned.plan.max_concurrency + 1e-9)
    assert fits >= 1
    chunk = planned.context.max_in_flight_tokens
    for request_id in range(fits):
        assert admit_full_length(allocator, request_id, chunk) is None, (model, request_id)
    if exact:
        refused = admit_full_length(allocator, fits, chunk)
        assert refused is not None and refused.reason == NO_FREE_BLOCKS
