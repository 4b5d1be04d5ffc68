"""Odd command-line arguments never end in a traceback: every refusal is a ``kvspec: error:``
line (exit 2) or argparse's usage error (``SystemExit(2)``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvspec_core.cli.arguments import positive_int
from kvspec_core.cli.main import EXIT_USAGE, main
from kvspec_core.cli.sizes import MAX_SIZE_BYTES, SizeError, parse_size
from kvspec_core.errors import ConfigError
from kvspec_core.models.catalog import preset_names, resolve_model
from kvspec_core.validation import MAX_FIELD_VALUE

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


@pytest.mark.parametrize(
    "model", [OVER_LONG_MODEL, "dir/" + OVER_LONG_MODEL, "/".join(["d" * 200] * 30)]
)
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
    st.sampled_from(
        ["0", "-1GiB", "2EiB", "99999999TiB", "0.1B", "1e9", "GiB", " 40 gib ", "9" * 5000]
    ),
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


def _is_ascii_number(text: str) -> bool:
    return text.strip(" \t") != "" and all(char in ASCII_NUMBER_CHARS for char in text)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_arguments())
def test_fuzzed_plan_arguments_never_raise(argv: list[str]) -> None:
    status, stderr = run_cli(argv)
    event(f"exit status {status}")
    assert status in (0, EXIT_USAGE), stderr
    if status == EXIT_USAGE:
        assert stderr.startswith(("kvspec: error: ", "usage: kvspec")), stderr
        assert "Traceback" not in stderr
    else:
        # A plan was made: every number it was given was written in ASCII digits.
        numbers = [value for option, value in pairwise(argv) if option in NUMBER_OPTIONS]
        assert all(_is_ascii_number(value) for value in numbers), argv


#: What an integer option may hold: ASCII digits and the spaces around them.
ASCII_NUMBER_CHARS = frozenset("0123456789 \t")

#: Integers Python's int() reads but a user does not mean (Arabic-Indic, fullwidth,
#: Devanagari digits; underscores; signs).
NOT_ASCII_INTEGERS = ["٢", "２", "२", "2_0", "1_000", "+2", "٢0", "2\u2003", "\u20072"]


@pytest.mark.parametrize("option", NUMBER_OPTIONS + ("--pp",))
@pytest.mark.parametrize("value", NOT_ASCII_INTEGERS)
def test_integer_options_take_ascii_digits_only(option: str, value: str) -> None:
    """``--tp ٢`` planned TP 2 and ``--tp 2_0`` TP 20 (int() reads both)."""
    status, stderr = run_cli(["plan", "llama-3.1-8b", "--memory", "40GiB", option, value])
    assert status == EXIT_USAGE
    assert (
        f"argument {option}: {value!r} is not an integer written with the ASCII digits 0-9"
        in stderr
    ), stderr


@pytest.mark.parametrize("partition", ["٢٧,5", "16,1_6", "+16,16"])
def test_a_pipeline_partition_takes_ascii_digits_only(partition: str) -> None:
    status, stderr = run_cli(
        ["plan", "llama-3.1-8b", "--memory", "40GiB", "--pp", "2", "--pp-partition", partition]
    )
    assert status == EXIT_USAGE and "ASCII digits 0-9" in stderr, stderr


@pytest.mark.parametrize("seed", ["٣", "1_0", "+1"])
def test_a_simulate_seed_takes_ascii_digits_only(seed: str) -> None:
    status, stderr = run_cli(
        [
            "simulate",
            "llama-3.1-8b",
            "--memory",
            "40GiB",
            "--seed",
            seed,
            "--requests",
            "3",
            "--no-progress",
        ]
    )
    assert status == EXIT_USAGE and "ASCII digits 0-9" in stderr, stderr


@pytest.mark.parametrize(
    "memory", ["٤٠GiB", "４0GiB", "4_0GiB", "40\u2003GiB", "\u200340GiB", "40ＧiB"]
)
def test_sizes_take_ascii_digits_and_spaces_only(memory: str) -> None:
    status, stderr = run_cli(["plan", "llama-3.1-8b", "--memory", memory])
    assert status == EXIT_USAGE
    assert stderr.startswith(f"kvspec: error: --memory {memory!r} is not a size"), stderr


#: Characters numbers are made of, in ASCII and in other scripts, and what sits around them.
NUMBER_LIKE = st.text(st.sampled_from("0123456789٠١٢٣٤５６७_ .\t\u2003\u00a0+-GiBkM"), max_size=8)


@given(st.one_of(NUMBER_LIKE, st.text(st.characters(blacklist_categories=()), max_size=8)))
def test_one_reading_of_numbers_for_integers_and_sizes(text: str) -> None:
    """Whatever the text, an integer option and a size read numbers alike: only ASCII
    digits (ASCII spaces around), and a plain integer as the same number."""
    try:
        as_integer: int | None = positive_int(text)
    except argparse.ArgumentTypeError:
        as_integer = None
    try:
        as_size: int | None = parse_size(text)
    except SizeError:
        as_size = None
    stripped = text.strip(" \t")
    integer = int(stripped) if _is_ascii_number(text) and stripped.isdigit() else None
    if integer is not None and 1 <= integer <= MAX_FIELD_VALUE:
        assert as_integer == integer
    else:
        assert as_integer is None
    if integer is not None and 1 <= integer <= MAX_SIZE_BYTES:
        assert as_size == integer
    if as_size is not None:  # a fraction or a unit, but ASCII through and through
        assert all(char.isascii() and (char.isalnum() or char in " \t.") for char in text)


@pytest.mark.parametrize("plot", ["", "   "])
def test_an_empty_plot_file_name_is_refused(plot: str) -> None:
    """``--plot ''`` used to exit 0 having written nothing."""
    status, stderr = run_cli(["plan", "llama-3.1-8b", "--memory", "40GiB", "--plot", plot])
    assert status == EXIT_USAGE
    assert f"argument --plot: {plot!r} is an empty file name" in stderr, stderr
    assert os.listdir(".") == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_arguments(), st.one_of(st.integers().map(str), ODD_NUMBERS))
def test_fuzzed_simulate_arguments_never_raise(plan_argv: list[str], seed: str) -> None:
    argv = ["simulate", *plan_argv[1:], "--seed", seed, "--requests", "3", "--no-progress"]
    status, stderr = run_cli(argv)
    assert status in (0, EXIT_USAGE), stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("size", ["65537", "100000000", "1000000000000"])
def test_a_block_size_past_the_limit_is_refused_naming_the_option(size: str) -> None:
    """Found in review: a huge --block-size overflowed the spec's page size and was reported
    as a bug of the 'core' plugin; the capacity error below it suggested a larger budget."""
    status, stderr = run_cli(["plan", "llama-3.1-8b", "--memory", "40GiB", "--block-size", size])
    assert status == 2
    assert f"argument --block-size: {size!r} tokens per block is over 65,536" in stderr
    assert "plugin" not in stderr
