"""``kvspec simulate``: plan a preset, replay the trace through its allocator, report."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from kvspec_core.cli import simulate_replay
from kvspec_core.cli.main import main
from kvspec_core.runtime.trace import make_trace

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "bench" / "request_trace.py"


def simulate(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    code = main(["simulate", *args, "--json", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_full_attention_preset_admits_everything_and_hits_shared_prompts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    report = simulate(
        capsys, "llama-3.1-8b", "--memory", "40GiB", "--requests", "40", "--max-model-len", "8192"
    )
    assert report["model"] == "llama-3.1-8b" and report["groups"] == ["full_attention"]
    assert report["requests"] == report["admitted"] == 40
    assert report["waited_admissions"] == 0 and report["preemptions"] == 0
    assert 0 < report["hit_tokens"] < report["prompt_tokens"]
    assert report["prefix_hit_rate"] == pytest.approx(
        report["hit_tokens"] / report["prompt_tokens"]
    )
    assert 0 < report["peak_usage"] <= 1 and report["peak_used_blocks"] <= report["usable_blocks"]
    again = simulate(
        capsys, "llama-3.1-8b", "--memory", "40GiB", "--requests", "40", "--max-model-len", "8192"
    )
    assert again["hit_tokens"] == report["hit_tokens"]
    # Every request ran to its end: the longest held its prompt and every decoded token.
    held: dict[object, int] = {}
    for event in make_trace(0, 40):
        if event[0] == "admit":
            held[event[1]] = len(event[2])
        elif event[0] == "decode":
            held[event[1]] += 1
    assert report["longest_request_tokens"] == max(held.values())


def test_a_tight_budget_makes_admissions_wait(capsys: pytest.CaptureFixture[str]) -> None:
    report = simulate(capsys, "gemma-2-9b", "--memory", "3GiB", "--requests", "30", "--seed", "1")
    assert report["groups"] == ["sliding_window", "full_attention"]
    assert report["waited_admissions"] > 0
    assert report["peak_usage"] == pytest.approx(1.0, abs=0.05)


def test_hybrid_mamba_preset_replays(capsys: pytest.CaptureFixture[str]) -> None:
    report = simulate(
        capsys,
        "jamba-1.5-mini",
        "--memory",
        "20GiB",
        "--requests",
        "20",
        "--max-model-len",
        "16384",
    )
    assert "mamba" in report["groups"]
    assert report["admitted"] == 20


def test_a_full_pool_shows_beside_a_low_overall_peak(capsys: pytest.CaptureFixture[str]) -> None:
    """Jamba planned for 262,144-token requests: its Mamba pool holds states for 5 requests
    at once, its attention pool blocks for the whole length. Short requests fill the Mamba
    pool (admissions wait, decodes preempt) while the overall peak stays near 3%: the
    per-pool peaks say which pool held the trace back."""
    args = ("jamba-1.5-mini", "--memory", "20GiB", "--requests", "60")
    report = simulate(capsys, *args)
    peaks, usable = report["peak_used_blocks_by_pool"], report["usable_blocks_by_pool"]
    assert len(peaks) == len(usable) == 2 and sum(usable) == report["usable_blocks"]
    assert peaks[0] == usable[0] == 70 and peaks[1] < usable[1] // 10
    assert report["peak_usage"] < 0.05 and report["waited_admissions"] > 0
    assert report["peak_used_blocks"] <= sum(peaks)
    assert main(["simulate", *args, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "  pool 0                100.0% (70 of 70 blocks)" in text
    assert "  pool 1 " in text


def test_human_output_is_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "mistral-7b", "--memory", "8GiB", "--requests", "10"]) == 0
    captured = capsys.readouterr()
    assert "prefix-hit rate" in captured.out and "admissions that waited" in captured.out
    assert "event" in captured.err  # the progress bar (or counter) goes to stderr


def test_unknown_model_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "no-such-model", "--memory", "1GiB", "--requests", "5"]) == 2
    assert "kvspec: error:" in capsys.readouterr().err


def test_a_budget_too_small_names_the_max_model_len_to_pass(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Found by review: kvspec plan names the exact option, simulate only the length.
    args = ["llama-3.1-8b", "--memory", "8GiB", "--requests", "5", "--no-progress"]
    assert main(["simulate", *args]) == 2
    assert "(pass --max-model-len 65520)" in capsys.readouterr().err


def test_progress_falls_back_to_a_counter_without_tqdm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    tick, close = simulate_replay._progress(40, True)
    assert tick is not None
    for _ in range(40):
        tick()
    close()
    assert "replaying: 40/40 events" in capsys.readouterr().err
    tick, close = simulate_replay._progress(None, True)
    assert tick is not None
    for _ in range(20_000):
        tick()
    close()
    assert "replaying: 20000 events" in capsys.readouterr().err


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="shared trace generator not present")
def test_packaged_trace_matches_the_shared_generator() -> None:
    spec = importlib.util.spec_from_file_location("shared_request_trace", SHARED_TRACE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for seed in (0, 3):
        assert list(make_trace(seed, 30)) == list(module.make_trace(seed, 30))
