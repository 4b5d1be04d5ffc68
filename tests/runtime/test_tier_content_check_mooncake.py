"""``benchmarks/tier_content_check.py`` on real long-prompt traffic: the first 600 requests of
Mooncake's FAST'25 synthetic trace (``tests/data/mooncake_synthetic_trace_600.jsonl``, see
``tests/data/README.md``; prompts up to 134,773 tokens) through tiered allocators, every hit
block holding its own prefix, and a wrong load found there too.

The pools are the smallest that keep each case's coverage: a device pool must hold the
slice's longest prompt (8,424 blocks of 16), else the admission queue blocks for good."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import attrs
import pytest
from runtime_testkit import load_content_check, load_replay_trace

from kvspec_core.runtime.tiers import KEEP_EVERYTHING, LOAD, WRITE_BACK

SLICE = Path(__file__).resolve().parents[1] / "data" / "mooncake_synthetic_trace_600.jsonl"
SLICE_LINES = 600
SLICE_SHA256 = "adce150265db1f3ddddca83475165e7aed1c594f9e91c2bd693a8c0be92cbd0a"
#: The replay of the slice (default round loop: 32 running, outputs capped at 200 tokens).
SLICE_EVENTS = 75_537
LONGEST_PROMPT = 134_773
#: ``load_trace``'s prefill chunk for the sliding-window model on a Mooncake trace.
HYBRID_PREFILL_CHUNK = 16_384


@pytest.fixture(scope="module")
def checker() -> Iterator[ModuleType]:
    yield from load_content_check("tier_content_check_on_mooncake")


@pytest.fixture(scope="module")
def traces(checker: ModuleType) -> dict[bool, Any]:
    """``load_trace``'s answer for the slice, full attention (False) and hybrid (True)."""
    return {
        hybrid: checker.load_trace(f"mooncake:{SLICE}", None, hybrid) for hybrid in (False, True)
    }


def test_the_slice_is_the_traces_first_600_lines(traces: dict[bool, Any]) -> None:
    assert hashlib.sha256(SLICE.read_bytes()).hexdigest() == SLICE_SHA256
    for hybrid, trace in traces.items():
        assert trace.requests == SLICE_LINES
        assert len(trace.events) == SLICE_EVENTS
        assert trace.prefill_chunk == (HYBRID_PREFILL_CHUNK if hybrid else None)
    admits = [event for event in traces[False].events if event[0] == "admit"]
    assert len(admits) == SLICE_LINES
    assert max(len(event[2]) for event in admits) == LONGEST_PROMPT


def test_the_slice_matches_the_full_trace_where_it_is_at_hand() -> None:
    full_trace = load_replay_trace("replay_trace_for_mooncake_slice").MOONCAKE_DEFAULT_FILE
    if not full_trace.is_file():
        pytest.skip(f"{full_trace} is not here (only beside a checkout with shared/)")
    with full_trace.open("rb") as lines:
        head = b"".join(line for _, line in zip(range(SLICE_LINES), lines, strict=False))
    assert head == SLICE.read_bytes()


@pytest.mark.parametrize(
    ("model", "pools", "floor"),
    [
        # Measured: 5,859 blocks checked, 93,744 hit tokens, 4,803 host->device blocks.
        ("full_attention", (12288, 262144, 0), 2900),
        # Measured: 5,859 checked, 93,744 hit tokens; 1,072 host->device, 3,731 disk->device.
        ("full_attention", (12288, 8192, 262144), 2900),
        # Chunked prefill; measured: 51,366 checked, 443,824 hit tokens, 1,809 host->device.
        ("hybrid", (10240, 40960, 0), 25000),
    ],
    ids=["full-host", "full-host-disk", "hybrid-host-chunked"],
)
def test_every_hit_block_holds_its_prefix(
    checker: ModuleType,
    traces: dict[bool, Any],
    model: str,
    pools: tuple[int, int, int],
    floor: int,
) -> None:
    trace = traces[model == "hybrid"]
    blocks, host_blocks, disk_blocks = pools
    allocator = checker.build_allocator(
        blocks,
        model,
        "lru",
        trace.max_model_len,
        host_blocks,
        disk_blocks,
        WRITE_BACK,
        KEEP_EVERYTHING,
    )
    figures = checker.check_replay(trace.events, allocator, trace.prefill_chunk)
    assert figures["mismatches"] == 0, figures["shown_mismatches"]
    assert figures["waiting_at_end"] == 0
    moved = figures["blocks_moved"]
    # The tiers were used: blocks came back from the host (and the disk) and were checked.
    assert moved.get("host->device", 0) > 0
    assert not disk_blocks or moved.get("disk->device", 0) > 0
    assert figures["blocks_checked"] > floor
    assert figures["blocks_checked"] > figures["hit_tokens"] // 16 // 2 > 0


def test_a_load_from_the_wrong_slots_is_found(checker: ModuleType, traces: dict[bool, Any]) -> None:
    trace = traces[False]
    allocator = checker.build_allocator(
        12288,
        "full_attention",
        "lru",
        trace.max_model_len,
        262144,
    )
    take = allocator.take_transfers
    rotated: list[object] = []

    def take_rotated(*args: object) -> list:
        # An allocator that named its loads' slots one place off.
        transfers = []
        for transfer in take(*args):
            if transfer.kind == LOAD and len(set(transfer.source_blocks)) > 1:
                blocks = transfer.source_blocks
                transfer = attrs.evolve(transfer, source_blocks=blocks[1:] + blocks[:1])
                rotated.append(transfer)
            transfers.append(transfer)
        return transfers

    allocator.take_transfers = take_rotated
    # The slice's first 10,000 events (108 requests arrive) hold loads enough: a few
    # hundred mismatches, in a fraction of the whole replay's time.
    figures = checker.check_replay(trace.events[:10_000], allocator)
    assert rotated
    assert figures["mismatches"] > 0
    assert "never written" not in str(figures["shown_mismatches"][0]["found"])
