"""Plain-text tables for human CLI output."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], align_right: Sequence[int] = ()
) -> str:
    """Columns padded to their widest cell; columns in ``align_right`` are right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            cell.rjust(widths[i]) if i in align_right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ).rstrip()

    lines = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(row) for row in cells[1:]]
    return "\n".join(lines)
