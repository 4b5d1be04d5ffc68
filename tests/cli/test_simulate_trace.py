"""``kvspec simulate --trace``: built-in traces by name, Mooncake-format JSONL files by path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvspec_core.cli.main import main


def write_trace(path: Path, rows: list[tuple[float, int, int, list[int]]]) -> Path:
    lines = [
        json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids})
        for ts, n, out, ids in rows
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def tiny_trace(tmp_path: Path) -> Path:
    # Request 1 (arriving second) repeats request 0's two blocks and adds a partial third:
    # a prefix cache serves it all of request 0's 1,024 tokens. Request 2 shares nothing.
    return write_trace(
        tmp_path / "tiny.jsonl",
        [(0, 1024, 3, [10, 11]), (1, 1100, 2, [10, 11, 12]), (2, 40, 1, [20])],
    )


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    # A later --max-model-len in args overrides the 4,096 default here.
    code = main(["simulate", "llama-3.1-8b", "--memory", "4GiB", "--max-model-len", "4096", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_trace_file_replays_end_to_end_with_json(
    capsys: pytest.CaptureFixture[str], tiny_trace: Path
) -> None:
    code, out, err = run(capsys, "--trace", str(tiny_trace), "--json", "--no-progress")
    assert code == 0, err
    report = json.loads(out)
    assert report["trace"] == str(tiny_trace) and report["seed"] is None
    assert report["skipped_too_long"] == 0
    assert report["requests"] == report["admitted"] == 3
    assert report["prompt_tokens"] == 1024 + 1100 + 40
    assert report["hit_tokens"] == 1024
    # admit + decodes + finish per request: (1+3+1) + (1+2+1) + (1+1+1)
    assert report["events"] == 12


def test_requests_takes_the_first_rows(
    capsys: pytest.CaptureFixture[str], tiny_trace: Path
) -> None:
    code, out, err = run(
        capsys, "--trace", str(tiny_trace), "--requests", "1", "--json", "--no-progress"
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["requests"] == 1 and report["hit_tokens"] == 0


def test_the_progress_bar_goes_to_stderr_never_into_json(
    capsys: pytest.CaptureFixture[str], tiny_trace: Path
) -> None:
    code, out, err = run(capsys, "--trace", str(tiny_trace), "--json")
    assert code == 0, err
    assert json.loads(out)["events"] == 12  # stdout is the JSON document alone
    assert "12/12" in err  # the bar (or the counter without tqdm) knows the total


def test_human_output_names_the_trace(capsys: pytest.CaptureFixture[str], tiny_trace: Path) -> None:
    code, out, _ = run(capsys, "--trace", str(tiny_trace), "--no-progress")
    assert code == 0
    assert f"{tiny_trace} (Mooncake format)" in out and "1,024 of 2,164" in out


def test_prompts_over_max_model_len_are_refused_up_front(
    capsys: pytest.CaptureFixture[str], tiny_trace: Path
) -> None:
    code, out, err = run(capsys, "--trace", str(tiny_trace), "--max-model-len", "1050")
    assert code == 2 and out == ""
    assert "1 of the 3 requests taken have prompts longer than max_model_len=1,050" in err
    assert "(the longest: line 2, 1,100 tokens)" in err
    assert "--max-model-len 1102" in err and "--skip-too-long" in err


def test_a_suggested_length_past_the_model_names_the_flag_it_needs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Llama-3.1 was built for 131,072 tokens: --max-model-len 140,002 alone would be refused
    # next, so the first message says so (else the user learns it in two runs).
    long_trace = write_trace(tmp_path / "long.jsonl", [(0, 140_000, 2, list(range(274)))])
    code, out, err = run(capsys, "--trace", str(long_trace))
    assert code == 2 and out == ""
    assert "--max-model-len 140002" in err
    assert "past the 131,072 tokens the model was built for" in err
    assert "--allow-long-max-model-len" in err
    code, out, err = run(
        capsys, "--trace", str(tiny_trace_path(tmp_path)), "--max-model-len", "1050"
    )
    assert code == 2 and "--allow-long-max-model-len" not in err


def tiny_trace_path(folder: Path) -> Path:
    return write_trace(folder / "short.jsonl", [(0, 1100, 2, [10, 11, 12])])


def test_skip_too_long_leaves_them_out_and_counts_them(
    capsys: pytest.CaptureFixture[str], tiny_trace: Path
) -> None:
    args = ("--trace", str(tiny_trace), "--max-model-len", "1050", "--skip-too-long")
    code, out, err = run(capsys, *args, "--json", "--no-progress")
    assert code == 0, err
    report = json.loads(out)
    assert report["skipped_too_long"] == 1 and report["requests"] == 2
    assert report["hit_tokens"] == 0
    code, out, _ = run(capsys, *args, "--no-progress")
    assert "1 left out: prompt over max_model_len" in out
    code, out, err = run(
        capsys, "--trace", str(tiny_trace), "--max-model-len", "30", "--skip-too-long"
    )
    assert code == 2 and "nothing is left to replay" in err


def test_a_bad_row_is_one_error_line_naming_the_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = write_trace(tmp_path / "bad.jsonl", [(0, 10, 1, [1]), (1, 600, 1, [1])])
    code, out, err = run(capsys, "--trace", str(path))
    assert code == 2 and out == ""
    assert err.startswith("kvspec: error: ") and "line 2" in err and "input_length=600" in err
    assert "Traceback" not in err


def test_options_that_do_not_fit_the_trace_are_refused(
    capsys: pytest.CaptureFixture[str], tiny_trace: Path
) -> None:
    code, _, err = run(capsys, "--trace", str(tiny_trace), "--seed", "1")
    assert code == 2 and "drop --seed" in err
    code, _, err = run(capsys, "--skip-too-long", "--requests", "2")
    assert code == 2 and "--skip-too-long applies to a trace file" in err


def test_a_built_in_name_that_is_also_a_file_here_is_ambiguous(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    write_trace(tmp_path / "chat", [(0, 10, 1, [1])])
    code, _, err = run(capsys, "--trace", "chat", "--requests", "2")
    assert code == 2 and "write ./chat for the file" in err
    code, out, err = run(capsys, "--trace", "./chat", "--json", "--no-progress")
    assert code == 0, err
    assert json.loads(out)["requests"] == 1


def test_the_built_in_chat_trace_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "--trace", "chat", "--requests", "5", "--seed", "2", "--json", "--no-progress"
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["trace"] == "chat" and report["seed"] == 2 and report["requests"] == 5


def test_a_prompt_over_a_steps_tokens_is_counted_as_over_the_admission_cap(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Gemma-2's sliding-window layers (window 4,096) hold at most the window plus a step's
    # --max-in-flight-tokens; the replay prefills in one step, so a 6,000-token prompt
    # cannot run at 1,000 tokens per step although it fits max_model_len.
    path = write_trace(tmp_path / "t.jsonl", [(0, 6000, 1, list(range(12))), (1, 40, 1, [20])])
    code = main(
        ["simulate", "gemma-2-9b", "--memory", "8GiB", "--max-model-len", "8192"]
        + ["--max-in-flight-tokens", "1000", "--trace", str(path), "--no-progress"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "2 (1 admitted, 0 never admitted, 1 over the admission cap)" in out


def test_requests_cut_short_at_max_model_len_are_shown_in_the_table(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Found in review: prompts that fit but whose output does not were counted only in
    --json; the table did not show them."""
    trace = write_trace(
        tmp_path / "long_outputs.jsonl",
        [(0, 1900, 200, [1, 2, 3, 4]), (1, 1900, 200, [5, 6, 7, 8])],
    )
    code, out, err = run(capsys, "--trace", str(trace), "--max-model-len", "2032", "--no-progress")
    assert code == 0, err
    assert "2 cut short at max_model_len)" in out
    code, out, err = run(capsys, "--trace", str(trace), "--no-progress")
    assert code == 0, err
    assert "cut short" not in out
