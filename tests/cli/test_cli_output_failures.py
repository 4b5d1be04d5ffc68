"""Standard output that cannot be written (a reader that went away, a full disk) ends the
``kvspec`` process with a status and at most one ``kvspec: error:`` line, never a traceback.

These run the real command in a subprocess: the failures live in file descriptors and in the
interpreter's shutdown flush, which an in-process call cannot reproduce.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec_core.cli.main import EXIT_BROKEN_PIPE, EXIT_FAILURE

DEV_FULL = Path("/dev/full")


def run_kvspec_into(stdout: int, *arguments: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvspec_core ARGUMENTS`` with ``stdout`` as its standard output."""
    return subprocess.run(
        [sys.executable, "-m", "kvspec_core", *arguments],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        check=False,
    )


def run_into_closed_pipe(*arguments: str) -> subprocess.CompletedProcess[str]:
    """Run with standard output a real pipe whose reading end is already closed (what
    ``kvspec models | head -1`` becomes once ``head`` has its line and exits)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return run_kvspec_into(write_end, *arguments)
    finally:
        os.close(write_end)


@pytest.mark.parametrize(
    "arguments",
    [("models", "--json"), ("--help",)],
    ids=["models-json", "help"],
)
def test_a_closed_pipe_ends_quietly_with_the_sigpipe_status(arguments: tuple[str, ...]) -> None:
    result = run_into_closed_pipe(*arguments)
    assert result.stderr == ""
    assert result.returncode == EXIT_BROKEN_PIPE == 128 + 13


@pytest.mark.skipif(not DEV_FULL.exists(), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize(
    "arguments",
    [("plan", "llama-3.1-8b", "--memory", "32GiB"), ("--version",)],
    ids=["plan", "version"],
)
def test_a_full_disk_is_one_kvspec_error_line(arguments: tuple[str, ...]) -> None:
    with DEV_FULL.open("w") as full:
        result = run_kvspec_into(full.fileno(), *arguments)
    assert result.returncode == EXIT_FAILURE != 0
    assert result.stderr.splitlines() == [
        "kvspec: error: cannot write the output to standard output: "
        "[Errno 28] No space left on device"
    ]


def test_output_still_reaches_a_reader_that_stays() -> None:
    read_end, write_end = os.pipe()
    with os.fdopen(read_end) as reader:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvspec_core", "models"],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(write_end)
        first_line = reader.readline()
        rest = reader.read()
        _, stderr = process.communicate(timeout=120)
    assert first_line.split()[0] == "preset" and "llama-3.1-8b" in rest
    assert process.returncode == 0 and stderr == ""
