"""Parsing byte sizes: ``40GiB``, ``512MiB``, ``80GB``, ``1.5TiB`` or plain bytes."""

from __future__ import annotations

import re

from kvspec_core.cli.ascii_numbers import match_ascii_decimal
from kvspec_core.errors import KVSpecError

#: Unit -> bytes. Binary units (KiB...) are powers of 1024, decimal ones (KB...) of 1000,
#: as the IEC and SI define them; units are matched case-insensitively.
UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
#: Largest size accepted (1 EiB): beyond any machine, far below integer trouble downstream.
MAX_SIZE_BYTES = 2**60

UNIT_NAMES = "B, KB, MB, GB, TB (powers of 1000), KiB, MiB, GiB, TiB (powers of 1024)"

#: After the number: ASCII spaces, an ASCII unit, ASCII spaces (``\s`` would take any
#: Unicode space, ``$`` a trailing newline).
_UNIT = re.compile(r"[ \t]*(?P<unit>[a-zA-Z]*)[ \t]*\Z")


class SizeError(KVSpecError, ValueError):
    """A size string that cannot be read as a positive number of bytes."""


def parse_size(text: str, *, what: str = "--memory") -> int:
    """Bytes in ``text``; fractional results are rounded down to whole bytes.

    Refuses, naming ``what`` and the accepted forms: malformed text, unknown units, zero,
    negative sizes and sizes above :data:`MAX_SIZE_BYTES`.
    """
    forms = (
        "a positive size such as 40GiB, 512MiB, 80GB or a number of bytes, written with "
        "the ASCII digits 0-9"
    )
    if text.strip().startswith("-"):
        raise SizeError(f"{what} {text!r} is negative; give {forms}")
    start = len(text) - len(text.lstrip(" \t"))
    number = match_ascii_decimal(text, start)
    match = _UNIT.match(text, number[1]) if number is not None else None
    if number is None or match is None:
        raise SizeError(f"{what} {text!r} is not a size; give {forms}")
    unit = match["unit"].lower() or "b"
    if unit not in UNITS:
        raise SizeError(
            f"{what} {text!r} has unknown unit {match['unit']!r}; known units: {UNIT_NAMES}"
        )
    value = int(number[0] * UNITS[unit])
    if value <= 0:
        raise SizeError(f"{what} {text!r} is less than one byte; give {forms}")
    if value > MAX_SIZE_BYTES:
        raise SizeError(f"{what} {text!r} exceeds the largest size accepted (1 EiB)")
    return value
