"""Odd command-line arguments never end in a traceback: every refusal is a ``kvspec: error:``
line (exit 2) or argparse's usage error (``SystemExit(2)``)."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvspec_core.cli.main import EXIT_USAGE, main
from kvspec_core.errors import ConfigError
from kvspec_core.models.catalog import preset_names, resolve_model

#: Longer than any file name (255 bytes) or path (4096 bytes) Linux accepts.
OVER_LONG_MODEL = "m" * 5000


@pytest.fixture(scope="module", autouse=True)
def in_an_empty_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fuzzed MODEL strings are tried as paths: ``.`` or ``tests`` must not name real files."""
    previous = Path.cwd()
    os.chdir(tmp_path_factory.mktemp("fuzz-cwd"))
    try:
        yield
    finally:
        os.chdir(previous)


def run_cli(argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of ``main(argv)``; argparse's exits count as statuses.

    StringIO, not capsys: the real stderr escapes lone surrogates (backslashreplace), a
    strict capture stream would fail where the command does not.
    """
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        try:
            status = main(argv)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
    return status, stderr.getvalue()


def test_an_over_long_model_name_is_an_error_naming_the_argument() -> None:
    status, stderr = run_cli(["plan", OVER_LONG_MODEL, "--memory", "8GiB"])
    assert status == EXIT_USAGE
    assert stderr.startswith("kvspec: error: MODEL 'mmmm") and "Traceback" not in stderr
    assert "(5000 characters)" in stderr and "too long" in stderr.lower()
    assert len(stderr) < 600, "the message quotes the start of the name, not all of it"


@pytest.mark.parametrize("model", [OVER_LONG_MODEL, "dir/" + OVER_LONG_MODEL,
                                   "/".join(["d" * 200] * 30)])
def test_resolving_an_over_long_path_is_a_config_error(model: str) -> None:
    with pytest.raises(ConfigError, match=r"MODEL .* cannot be used as a path"):
        resolve_model(model)


def odd_text(max_size: int = 40) -> st.SearchStrategy[str]:
    """Any characters, lone surrogates included (what undecodable argv bytes become)."""
    return st.text(st.characters(blacklist_categories=()), max_size=max_size)


ODD_MODELS = st.one_of(
    odd_text(),
    odd_text().map(lambda text: text + ".json"),
    odd_text().map(lambda text: "/" + text),
    st.integers(1, 9000).map(lambda length: "x" * length),
    st.sampled_from([".", "..", "/", "/dev/null", "/dev/zero", "/proc/self", "-", " ", ""]),
)
ODD_NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    odd_text(12),
    st.sampled_from(["0", "1e3", "1_000", "٣", " 7 ", "9" * 5000, "nan"]),
)
ODD_SIZES = st.one_of(
    st.sampled_from(["0", "-1GiB", "2EiB", "99999999TiB", "0.1B", "1e9", "GiB", " 40 gib ",
                     "9" * 5000]),
    odd_text(12),
    st.integers(-(2**70), 2**70).map(str),
)
ODD_DTYPES = st.one_of(st.sampled_from(["fp8", "fp8_e4m3", "bfloat16", "int4", ""]), odd_text(10))
NUMBER_OPTIONS = ("--max-model-len", "--block-size", "--tp", "--dcp", "--max-in-flight-tokens")
ODD_PARTS = ("model", "memory", "numbers", "dtype", "none")


@st.composite
def plan_arguments(draw: st.DrawFn) -> list[str]:
    """Arguments of ``plan`` where one part (or none) is odd and the others are plausible, so
    that odd values also reach planning, not only the first check that refuses them."""
    odd = draw(st.sampled_from(ODD_PARTS))
    model = draw(ODD_MODELS if odd == "model" else st.sampled_from(preset_names()))
    memory = draw(ODD_SIZES if odd == "memory" else st.sampled_from(["80GiB", "1TiB", "512MiB"]))
    argv = ["plan", model, "--memory", memory]
    numbers = ODD_NUMBERS if odd == "numbers" else st.integers(1, 8192).map(str)
    for option in draw(st.lists(st.sampled_from(NUMBER_OPTIONS), unique=True, max_size=3)):
        argv += [option, draw(numbers)]
    if odd == "dtype" or draw(st.booleans()):
        argv += ["--kv-cache-dtype", draw(ODD_DTYPES if odd == "dtype" else st.just("auto"))]
    if draw(st.booleans()):
        argv.append("--json")
    return argv


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_arguments())
def test_fuzzed_plan_arguments_never_raise(argv: list[str]) -> None:
    status, stderr = run_cli(argv)
    event(f"exit status {status}")
    assert status in (0, EXIT_USAGE), stderr
    if status == EXIT_USAGE:
        assert stderr.startswith(("kvspec: error: ", "usage: kvspec")), stderr
        assert "Traceback" not in stderr


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_arguments(), st.one_of(st.integers().map(str), ODD_NUMBERS))
def test_fuzzed_simulate_arguments_never_raise(plan_argv: list[str], seed: str) -> None:
    argv = ["simulate", *plan_argv[1:], "--seed", seed, "--requests", "3", "--no-progress"]
    status, stderr = run_cli(argv)
    assert status in (0, EXIT_USAGE), stderr
    assert "Traceback" not in stderr
