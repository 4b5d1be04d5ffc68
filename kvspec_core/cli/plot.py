"""PNG charts for the CLI (optional: needs matplotlib, ``pip install kvspec-core[plot]``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvspec_core.errors import KVSpecError

#: What to install when matplotlib is missing.
PLOT_EXTRA = "pip install kvspec-core[plot]"


class PlotError(KVSpecError, RuntimeError):
    """A plot could not be made or written."""


class PlotUnavailableError(PlotError):
    """A plot was asked for but matplotlib is not installed."""


def load_pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or a clear error."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise PlotUnavailableError(
            f"--plot needs matplotlib, which is not installed: {PLOT_EXTRA}"
        ) from None
    return pyplot


def _save_png(figure: Any, path: str | Path) -> Path:
    """Lay ``figure`` out and write it to ``path`` as a PNG, or a clear error."""
    figure.tight_layout()
    target = Path(path)
    try:
        figure.savefig(target, format="png")
    except OSError as error:
        raise PlotError(f"cannot write the plot to {target}: {error}") from None
    return target


def plot_concurrency(
    curves: Mapping[str, Sequence[tuple[int, float | None]]],
    path: str | Path,
    *,
    title: str,
    max_model_len: int | None = None,
) -> Path:
    """Write a PNG of max concurrency against context length, one line per curve label.

    Points whose concurrency is ``None`` (a request does not fit) are left out of the line.
    Both axes are logarithmic: concurrency spans orders of magnitude across lengths.
    """
    pyplot = load_pyplot()
    figure, axes = pyplot.subplots(figsize=(8, 5), dpi=100)
    try:
        for label, points in curves.items():
            fitting = [
                (length, value) for length, value in points if value is not None and value > 0
            ]
            if not fitting:
                continue
            xs, ys = zip(*fitting, strict=True)
            axes.plot(xs, ys, marker="o", markersize=3, linewidth=1.5, label=label)
        if max_model_len is not None:
            axes.axvline(
                max_model_len,
                color="grey",
                linestyle=":",
                linewidth=1,
                label=f"max model len {max_model_len:,}",
            )
        axes.axhline(1.0, color="red", linestyle="--", linewidth=0.8, label="one request")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xlabel("context length (tokens)")
        axes.set_ylabel("max concurrency (requests)")
        axes.set_title(title, fontsize=10)
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
        return _save_png(figure, path)
    finally:
        pyplot.close(figure)


def plot_hit_rate_vs_host_memory(
    points: Sequence[tuple[int, float]],
    path: str | Path,
    *,
    title: str,
    device_bytes: int,
) -> Path:
    """Write a PNG of the prefix-hit rate (0..1) against the host tier's bytes.

    The x axis is in multiples of ``device_bytes`` (the device KV budget), linear, so the
    zero-host point (no host tier) stays on the chart.
    """
    pyplot = load_pyplot()
    figure, axes = pyplot.subplots(figsize=(8, 5), dpi=100)
    try:
        xs = [host / device_bytes for host, _ in points]
        ys = [100.0 * rate for _, rate in points]
        axes.plot(xs, ys, marker="o", markersize=4, linewidth=1.5)
        for x, y in zip(xs, ys, strict=True):
            axes.annotate(
                f"{y:.1f}%",
                (x, y),
                textcoords="offset points",
                xytext=(0, 6),
                ha="center",
                fontsize=8,
            )
        axes.set_xlabel("host tier memory (x the device KV budget)")
        axes.set_ylabel("prefix-hit rate (% of prompt tokens)")
        # Room above the highest point for its label (the frame clipped it).
        axes.set_ylim(bottom=0, top=max(ys, default=0.0) * 1.12 + 1.0)
        axes.set_title(title, fontsize=10)
        axes.grid(True, alpha=0.3)
        return _save_png(figure, path)
    finally:
        pyplot.close(figure)
