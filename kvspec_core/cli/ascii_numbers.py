"""Numbers typed on the command line: ASCII digits only, one reading for every option.

Python's ``int`` and ``Decimal`` read any Unicode decimal digit and underscores: ``--tp ٢``
planned TP 2 and ``--tp 2_0`` TP 20, while ``--memory ٤٠GiB`` was refused. A digit from
another script or a digit-group separator slipped in by a copy-paste is never what a user
means to size a cache with, so every integer option and every size goes through here and
accepts ``0``-``9`` (a ``.`` fraction for sizes), optionally surrounded by ASCII spaces.
"""

from __future__ import annotations

import re
from decimal import Decimal

#: ``[0-9]``, not ``\\d``: in a str pattern ``\\d`` matches every Unicode decimal digit.
_INTEGER = re.compile(r"[ \t]*(?P<sign>-?)(?P<digits>[0-9]+)[ \t]*\Z")
_DECIMAL = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?)")

#: How the accepted form is named in errors.
ASCII_INTEGER_FORM = "an integer written with the ASCII digits 0-9 (no sign, '_' or other digits)"


def parse_ascii_integer(text: str, *, signed: bool = False) -> int | None:
    """The integer ``text`` writes in ASCII digits (``-`` first if ``signed``), or ``None``
    when it writes anything else."""
    match = _INTEGER.match(text)
    if match is None or (match["sign"] and not signed):
        return None
    value = int(match["digits"])
    return -value if match["sign"] else value


def match_ascii_decimal(text: str, start: int = 0) -> tuple[Decimal, int] | None:
    """The non-negative decimal number (``40``, ``1.5``) in ASCII digits at ``text[start:]``
    and where it ends, or ``None`` when none starts there."""
    match = _DECIMAL.match(text, start)
    if match is None:
        return None
    return Decimal(match["number"]), match.end()
