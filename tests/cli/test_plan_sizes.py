"""Size strings for ``--memory``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec_core.byte_sizes import format_size
from kvspec_core.cli.sizes import MAX_SIZE_BYTES, UNITS, SizeError, parse_size
from kvspec_core.errors import KVSpecError


@pytest.mark.parametrize(
    "text, expected",
    [
        ("40GiB", 40 * 2**30),
        ("512MiB", 512 * 2**20),
        ("80GB", 80 * 10**9),
        ("123", 123),
        ("123B", 123),
        ("1.5TiB", 3 * 2**39),
        ("40gib", 40 * 2**30),
        (" 2 KiB ", 2048),
        ("1.5KB", 1500),
        ("1.9B", 1),
    ],
)
def test_sizes_parse(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("40GB?", "is not a size"),
        ("-1GiB", "is negative"),
        ("0", "less than one byte"),
        ("0.4B", "less than one byte"),
        ("12 parsecs", "unknown unit 'parsecs'"),
        ("", "is not a size"),
        ("GiB", "is not a size"),
        ("2EiB", "unknown unit"),
        ("9" * 30, "largest size"),
    ],
)
def test_bad_sizes_are_refused_naming_the_option(text: str, message: str) -> None:
    with pytest.raises(SizeError, match=message) as caught:
        parse_size(text)
    assert str(caught.value).startswith(f"--memory {text!r}")
    assert isinstance(caught.value, KVSpecError)


@settings(max_examples=50, deadline=None)
@given(number=st.integers(1, 10**6), unit=st.sampled_from(sorted(UNITS)))
def test_integer_sizes_round_trip_exactly(number: int, unit: str) -> None:
    expected = number * UNITS[unit]
    if expected > MAX_SIZE_BYTES:
        with pytest.raises(SizeError):
            parse_size(f"{number}{unit}")
        return
    assert parse_size(f"{number}{unit.upper()}") == parse_size(f"{number}{unit}") == expected


def test_format_size() -> None:
    assert format_size(40 * 2**30) == "40.00 GiB"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(3 * 2**40) == "3.00 TiB"


@pytest.mark.parametrize(
    "option, value",
    [
        ("--memory", "-1GiB"),
        ("--memory", "-.5GiB"),
        ("--host-memory", "-8GiB"),
        ("--overhead", "-1GiB"),
    ],
)
def test_a_negative_size_is_refused_by_its_own_check(
    option: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Found by review: argparse took '-1GiB' for an option and answered "argument
    # --overhead: expected one argument", which says nothing of the value.
    from plan_cli_testkit import fails

    budget = ["--gpu", "h100-80gb"] if option == "--overhead" else ["--memory", "40GiB"]
    if option == "--memory":
        budget = []
    err = fails(capsys, "llama-3.1-8b", *budget, option, value)
    assert f"{option} '{value}' is negative" in err


def test_only_an_options_negative_value_is_joined_to_it() -> None:
    from kvspec_core.cli.main import negative_values_joined

    assert negative_values_joined(["plan", "m", "--memory", "-1GiB", "--json"]) == [
        "plan",
        "m",
        "--memory=-1GiB",
        "--json",
    ]
    # Values that do not look negative, '--opt=value' and what follows '--' are left as
    # they are.
    unchanged = ["plan", "m", "--memory", "40GiB", "--tp=-2", "-x", "--", "--memory", "-1"]
    assert negative_values_joined(unchanged) == unchanged
