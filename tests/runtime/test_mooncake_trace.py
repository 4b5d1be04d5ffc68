"""Mooncake-format JSONL traces: events, token mapping, ordering, and every refused row."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core.errors import KVSpecError
from kvspec_core.runtime.mooncake_trace import (
    HASH_BLOCK_TOKENS,
    TraceFormatError,
    count_events,
    make_trace,
    read_mooncake_trace,
    trace_events,
)

SHARED_BENCH = Path(__file__).resolve().parents[3] / "shared" / "bench"


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def row(timestamp: float, input_length: int, output_length: int, hash_ids: list[int]) -> dict:
    return {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output_length,
        "hash_ids": hash_ids,
    }


def test_events_of_a_hand_written_trace(tmp_path: Path) -> None:
    # Row 1 arrives first; rows 0 and 2 tie on timestamp and keep file order. Row 0's last
    # block is partial (600 = 512 + 88); row 2's output_length 0 still decodes one token.
    path = write_trace(
        tmp_path / "t.jsonl",
        [row(5, 600, 2, [3, 4]), row(1, 512, 5, [3]), row(5, 3, 0, [7])],
    )
    block_3 = list(range(3 * 512, 4 * 512))
    fresh = (7 + 1 + 1) * 512  # above every prompt token: (top block id + 2) * 512
    assert list(make_trace(path, max_running=2, output_cap=3)) == [
        ("admit", 1, block_3),
        ("admit", 0, block_3 + list(range(4 * 512, 4 * 512 + 88))),
        ("decode", 1, fresh),
        ("decode", 0, fresh + 1),
        ("decode", 1, fresh + 2),
        ("decode", 0, fresh + 3),
        ("finish", 0),
        ("admit", 2, [7 * 512, 7 * 512 + 1, 7 * 512 + 2]),
        ("decode", 1, fresh + 4),
        ("finish", 1),
        ("decode", 2, fresh + 5),
        ("finish", 2),
    ]
    requests = read_mooncake_trace(path)
    assert [request.line for request in requests] == [1, 2, 3]
    assert count_events(requests, output_cap=3) == 12


def test_num_requests_takes_the_first_rows_and_reads_no_further(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(row(0, 10, 1, [0])) + "\nnot json at all\n")
    assert [event[0] for event in make_trace(path, 1)] == ["admit", "decode", "finish"]
    with pytest.raises(TraceFormatError, match="line 2"):
        read_mooncake_trace(path)


rows_strategy = st.lists(
    st.builds(
        lambda timestamp, ids, tail, output: row(
            timestamp, HASH_BLOCK_TOKENS * (len(ids) - 1) + tail, output, ids
        ),
        st.integers(0, 5),
        st.lists(st.integers(0, 6), min_size=1, max_size=3),
        st.integers(1, HASH_BLOCK_TOKENS),
        st.integers(0, 6),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=40, deadline=None)
@given(rows=rows_strategy, max_running=st.integers(1, 4), output_cap=st.integers(1, 5))
def test_trace_invariants(
    tmp_path_factory: pytest.TempPathFactory, rows: list[dict], max_running: int, output_cap: int
) -> None:
    path = write_trace(tmp_path_factory.mktemp("trace") / "t.jsonl", rows)
    events = list(make_trace(path, max_running=max_running, output_cap=output_cap))
    prompts = {event[1]: event[2] for event in events if event[0] == "admit"}
    # Arrival in timestamp order, ties in file order; every request exactly once.
    assert list(prompts) == sorted(range(len(rows)), key=lambda i: (rows[i]["timestamp"], i))
    top = max(max(r["hash_ids"]) for r in rows)
    decoded: dict[int, list[int]] = {rid: [] for rid in prompts}
    running: set[int] = set()
    for event in events:
        if event[0] == "admit":
            running.add(event[1])
            assert len(running) <= max_running
        elif event[0] == "decode":
            assert event[1] in running
            decoded[event[1]].append(event[2])
        else:
            running.remove(event[1])
    assert not running
    fresh = [token for tokens in decoded.values() for token in tokens]
    assert len(set(fresh)) == len(fresh) and min(fresh) > (top + 1) * HASH_BLOCK_TOKENS
    for rid, prompt in prompts.items():
        ids, length = rows[rid]["hash_ids"], rows[rid]["input_length"]
        assert len(prompt) == length
        assert all(prompt[i] == ids[i // 512] * 512 + i % 512 for i in range(length))
        assert len(decoded[rid]) == max(1, min(output_cap, rows[rid]["output_length"]))
    for a in prompts:
        for b in prompts:
            # Two prompts share whole blocks exactly as far as their hash ids agree.
            ids_a, ids_b = rows[a]["hash_ids"], rows[b]["hash_ids"]
            same = 0
            while same < min(len(ids_a), len(ids_b)) and ids_a[same] == ids_b[same]:
                same += 1
            shared = 0
            while shared < min(len(prompts[a]), len(prompts[b])) and (
                prompts[a][shared] == prompts[b][shared]
            ):
                shared += 1
            assert shared == min(same * 512, len(prompts[a]), len(prompts[b]))
    assert len(events) == count_events(read_mooncake_trace(path), output_cap)


def test_ids_too_large_for_token_ids_are_renumbered_in_order_of_first_appearance(
    tmp_path: Path,
) -> None:
    """Ids are labels: a file whose ids would make token ids of 2**32 and more gives the
    events of the same file with its ids numbered 0, 1, 2... as they first appear."""
    big = [[2**40, 2**40 + 1], [2**40, 7], [2**33]]
    small = [[0, 1], [0, 2], [3]]
    rows = [(0, 1000, 3), (1, 700, 2), (2, 5, 1)]

    def events(ids: list[list[int]], name: str) -> list[tuple]:
        path = write_trace(
            tmp_path / name,
            [row(*fields, hash_ids) for fields, hash_ids in zip(rows, ids, strict=True)],
        )
        return list(make_trace(path, max_running=2))

    renumbered = events(big, "big.jsonl")
    assert renumbered == events(small, "small.jsonl")
    tokens = [t for event in renumbered if event[0] != "finish" for t in event[2:3]]
    assert max(max(t) if isinstance(t, list) else t for t in tokens) < 2**32


def test_a_trace_too_large_for_token_ids_even_renumbered_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvspec_core.runtime.mooncake_trace as mooncake_trace

    monkeypatch.setattr(mooncake_trace, "TOKEN_ID_LIMIT", 4 * HASH_BLOCK_TOKENS)
    path = write_trace(tmp_path / "t.jsonl", [row(0, 512, 1, [0]), row(1, 1024, 1, [5, 6])])
    with pytest.raises(TraceFormatError, match="3 distinct hash_ids and 2 decode tokens"):
        list(make_trace(path))


GOOD = row(0, 600, 5, [1, 2])


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("", "the line is empty"),
        ("[1, 2]", "JSON list, not an object"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}), "'hash_ids' is missing"),
        (json.dumps({**GOOD, "hash_ids": "1,2"}), "'hash_ids'='1,2' is invalid"),
        (json.dumps({**GOOD, "hash_ids": [1, 2.0]}), "'hash_ids' is invalid: hash_ids[1]=2.0"),
        (json.dumps({**GOOD, "hash_ids": [1, -2]}), "hash_ids[1]=-2; it must be a list of"),
        (json.dumps({**GOOD, "hash_ids": [], "input_length": 1}), "at least one block"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "input_length"}), "'input_length'"),
        (json.dumps({**GOOD, "input_length": "600"}), "'input_length'='600' is invalid"),
        (json.dumps({**GOOD, "input_length": 0}), "int >= 1"),
        (json.dumps({**GOOD, "input_length": True}), "'input_length'=True is invalid"),
        (json.dumps({**GOOD, "input_length": 1025}), "input_length=1025 does not match"),
        (json.dumps({**GOOD, "input_length": 512}), "input_length=512 does not match"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "output_length"}), "'output_length'"),
        (json.dumps({**GOOD, "output_length": -1}), "'output_length'=-1 is invalid"),
        (json.dumps({**GOOD, "output_length": 2.5}), "'output_length'=2.5 is invalid"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "timestamp"}), "'timestamp' is missing"),
        (json.dumps({**GOOD, "timestamp": "now"}), "'timestamp'='now' is invalid"),
        (json.dumps({**GOOD, "timestamp": None}), "'timestamp'=None is invalid"),
        (
            '{"timestamp": NaN, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}',
            "finite",
        ),
    ],
)
def test_each_bad_row_is_refused_naming_file_line_and_field(
    tmp_path: Path, line: str, expected: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + line + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(TraceFormatError) as caught:
        read_mooncake_trace(path)
    message = str(caught.value)
    assert f"trace {str(path)!r}, line 2" in message and expected in message
    assert isinstance(caught.value, KVSpecError)  # the CLI turns it into one error line


def test_inconsistent_length_names_the_fix(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", [row(0, 1100, 1, [1, 2])])
    with pytest.raises(TraceFormatError, match="give 3 hash_ids or correct input_length"):
        read_mooncake_trace(path)


def test_unreadable_empty_and_binary_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot be read"):
        read_mooncake_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(TraceFormatError, match="is empty"):
        read_mooncake_trace(tmp_path / "empty.jsonl")
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        read_mooncake_trace(tmp_path / "binary.jsonl")


def test_bad_replay_options_are_refused_before_any_event(tmp_path: Path) -> None:
    requests = read_mooncake_trace(write_trace(tmp_path / "t.jsonl", [GOOD]))
    with pytest.raises(TraceFormatError, match="max_running=0"):
        trace_events(requests, max_running=0)
    with pytest.raises(TraceFormatError, match="output_cap=0"):
        trace_events(requests, output_cap=0)
    with pytest.raises(TraceFormatError, match="num_requests=0"):
        read_mooncake_trace(tmp_path / "t.jsonl", 0)


@pytest.mark.skipif(
    not (SHARED_BENCH / "mooncake_synthetic_trace.jsonl").exists(),
    reason="the shared Mooncake trace and its reference reader are not present",
)
def test_same_events_as_the_shared_reference_reader() -> None:
    spec = importlib.util.spec_from_file_location(
        "shared_mooncake_trace", SHARED_BENCH / "mooncake_trace.py"
    )
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    path = SHARED_BENCH / "mooncake_synthetic_trace.jsonl"
    for count in (1, 60):
        expected = list(reference.make_trace(num_requests=count, path=str(path)))
        assert list(make_trace(path, count)) == expected
