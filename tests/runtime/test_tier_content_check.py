"""``benchmarks/tier_content_check.py``: a trace through tiered allocators with a shadow of
every block's content finds every hit block holding its own prefix, and it does find the
false hits of a wrong copy or a missing load."""

from __future__ import annotations

import types
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import attrs
import pytest
from runtime_testkit import load_content_check, load_replay_trace

from kvspec_core.runtime import chat_trace
from kvspec_core.runtime.tiers import (
    KEEP_EVERYTHING,
    KEEP_FAMILY_RULES,
    LOAD,
    WRITE_BACK,
    WRITE_THROUGH,
)

MAX_MODEL_LEN = load_replay_trace("replay_trace_for_content_check").MAX_MODEL_LEN


@pytest.fixture(scope="module")
def checker() -> Iterator[ModuleType]:
    yield from load_content_check("tier_content_check_under_test")


@pytest.fixture(scope="module")
def chat_events() -> list[tuple]:
    return list(chat_trace.make_trace(seed=0, num_requests=150))


@pytest.mark.parametrize(
    ("model", "tiers", "policies", "prefill_chunk"),
    [
        ("full_attention", (3000, 0), (WRITE_BACK, KEEP_EVERYTHING), None),
        ("full_attention", (600, 3000), (WRITE_BACK, KEEP_EVERYTHING), None),
        ("full_attention", (600, 3000), (WRITE_THROUGH, KEEP_EVERYTHING), None),
        ("full_attention", (600, 3000), (WRITE_BACK, KEEP_EVERYTHING), 48),
        ("hybrid", (600, 3000), (WRITE_BACK, KEEP_EVERYTHING), None),
        ("hybrid", (600, 3000), (WRITE_THROUGH, KEEP_FAMILY_RULES), 48),
        ("mamba_hybrid", (600, 3000), (WRITE_BACK, KEEP_EVERYTHING), None),
        ("mamba_hybrid", (600, 3000), (WRITE_THROUGH, KEEP_FAMILY_RULES), 48),
    ],
)
def test_every_hit_block_holds_its_prefix(
    checker: ModuleType,
    chat_events: list[tuple],
    model: str,
    tiers: tuple[int, int],
    policies: tuple[str, str],
    prefill_chunk: int | None,
) -> None:
    allocator = checker.build_allocator(400, model, "lru", MAX_MODEL_LEN, *tiers, *policies)
    figures = checker.check_replay(chat_events, allocator, prefill_chunk)
    assert figures["mismatches"] == 0, figures["shown_mismatches"]
    moved = figures["blocks_moved"]
    # The tiers were used: blocks came back from the host (and the disk) and were checked.
    assert moved.get("host->device", 0) > 0
    assert tiers[1] == 0 or moved.get("host->disk", 0) > 0
    assert figures["blocks_checked"] > figures["hit_tokens"] // 16 // 2 > 0


def _take_then(allocator: object, change: object) -> None:
    take = allocator.take_transfers  # type: ignore[attr-defined]
    allocator.take_transfers = lambda *args: change(take(*args))  # type: ignore[attr-defined]


def test_a_load_from_the_wrong_slots_is_found(
    checker: ModuleType, chat_events: list[tuple]
) -> None:
    allocator = checker.build_allocator(400, "full_attention", "lru", MAX_MODEL_LEN, 3000)

    def rotate_loads(transfers: list) -> list:
        # An allocator that named its loads' slots one place off.
        return [
            attrs.evolve(t, source_blocks=t.source_blocks[1:] + t.source_blocks[:1])
            if t.kind == LOAD and len(set(t.source_blocks)) > 1
            else t
            for t in transfers
        ]

    _take_then(allocator, rotate_loads)
    figures = checker.check_replay(chat_events, allocator)
    assert figures["mismatches"] > 0
    assert "never written" not in str(figures["shown_mismatches"][0]["expected"])


def test_a_load_the_engine_never_ran_is_found(
    checker: ModuleType, chat_events: list[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    allocator = checker.build_allocator(400, "mamba_hybrid", "lru", MAX_MODEL_LEN, 600)
    skipped: list[object] = []
    copy = checker.Shadow.copy

    def copy_but_the_first_load(shadow: object, transfers: list) -> None:
        # The first load is confirmed without being run: its destination keeps whatever
        # the device block held before.
        kept = []
        for transfer in transfers:
            if transfer.kind == LOAD and not skipped:
                skipped.append(transfer)
            else:
                kept.append(transfer)
        copy(shadow, kept)

    monkeypatch.setattr(checker.Shadow, "copy", copy_but_the_first_load)
    figures = checker.check_replay(chat_events, allocator)
    assert skipped
    assert figures["mismatches"] > 0


@pytest.mark.parametrize(("model", "group"), [("full_attention", 0), ("hybrid", 1)])
def test_a_hole_in_a_hit_is_found(
    checker: ModuleType,
    chat_events: list[tuple],
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    group: int,
) -> None:
    allocator = checker.build_allocator(400, model, "lru", MAX_MODEL_LEN, 600, 3000)
    check = checker.Shadow.check
    holes: list[object] = []

    def check_with_a_hole(shadow: Any, request: Any, hit: int) -> None:
        # The first hit's table, as the check sees it, lacks the block before the hit:
        # one the next token reads, in full attention as in a sliding window.
        if not hit or holes:
            check(shadow, request, hit)
            return
        holes.append(request.request_id)

        def block_ids(request_id: object) -> tuple[tuple[int, ...], ...]:
            tables = [list(table) for table in allocator.block_ids(request_id)]
            tables[group][hit // 16 - 1] = 0
            return tuple(map(tuple, tables))

        shadow.allocator = types.SimpleNamespace(block_ids=block_ids)
        try:
            check(shadow, request, hit)
        finally:
            shadow.allocator = allocator

    monkeypatch.setattr(checker.Shadow, "check", check_with_a_hole)
    figures = checker.check_replay(chat_events, allocator)
    assert holes
    assert figures["mismatches"] == 1
    assert figures["shown_mismatches"][0]["found"] == "'none'"
