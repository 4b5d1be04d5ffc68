"""``kvspec plan --plot``: a real PNG of max concurrency against context length."""

from __future__ import annotations

import struct
import sys
from itertools import pairwise
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from kvspec_core.cli.main import main
from kvspec_core.models.catalog import load_preset
from kvspec_core.models.planning import concurrency_curve, context_lengths
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import PluginManager

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_writes_a_png_with_one_curve_per_dtype(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "concurrency.png"
    assert (
        main(
            [
                "plan",
                "llama-3.1-8b",
                "--memory",
                "40GiB",
                "--plot",
                str(target),
                "--kv-cache-dtype",
                "auto",
                "--kv-cache-dtype",
                "fp8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert f"plot             {target}" in out
    assert png_size(target) == (800, 500)
    pixels = matplotlib.image.imread(str(target))
    assert pixels.shape[:2] == (500, 800)
    rgb = pixels[..., :3]
    assert float(rgb.std()) > 0.05  # not a blank canvas
    colours = {tuple(px) for px in (rgb.reshape(-1, 3) * 255).astype(np.uint8)[::7]}
    assert len(colours) > 20  # lines, text, grid and legend in several colours
    # Two dtype curves are drawn in matplotlib's first two cycle colours (C0 blue, C1 orange).
    flat = (rgb.reshape(-1, 3) * 255).astype(int)
    for colour in ((31, 119, 180), (255, 127, 14)):
        assert int((np.abs(flat - colour).sum(axis=1) < 30).sum()) > 200, colour


def test_json_output_names_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "p.png"
    assert (
        main(["plan", "jamba-1.5-mini", "--memory", "40GiB", "--plot", str(target), "--json"]) == 0
    )
    assert f'"plot": "{target}"' in capsys.readouterr().out
    assert png_size(target) == (800, 500)


def test_missing_matplotlib_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes ``import matplotlib`` fail
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    target = tmp_path / "never.png"
    assert main(["plan", "llama-3.1-8b", "--memory", "40GiB", "--plot", str(target)]) == 2
    captured = capsys.readouterr()
    assert "matplotlib" in captured.err and "pip install kvspec-core[plot]" in captured.err
    assert "Traceback" not in captured.err and captured.out == ""
    assert not target.exists()


def test_an_unwritable_plot_path_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "no" / "such" / "folder" / "p.png"
    with pytest.raises(SystemExit) as exited:
        main(["plan", "llama-3.1-8b", "--memory", "40GiB", "--plot", str(target)])
    assert exited.value.code == 2
    assert "does not exist; create it first" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["plot.svg", "plot", "folder"])
def test_a_plot_name_that_is_not_a_png_file_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """Found in review: ``--plot out.svg`` wrote PNG bytes under an SVG name, and a path
    that could not be written failed only after simulate's whole sweep of replays."""
    (tmp_path / "folder.png").mkdir()
    target = tmp_path / (name + ".png" if name == "folder" else name)
    for command in (["plan", "llama-3.1-8b", "--memory", "40GiB"], ["simulate", "llama-3.1-8b"]):
        with pytest.raises(SystemExit) as exited:
            main([*command, "--plot", str(target)])
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert "argument --plot" in error and ("ending in .png" in error or "directory" in error)


def test_context_lengths_span_up_to_the_max_model_len() -> None:
    lengths = context_lengths(131072, 16)
    assert lengths[0] == 256 and lengths[-1] == 131072
    assert lengths == sorted(set(lengths)) and len(lengths) == 24
    assert context_lengths(100, 16) == [100]


def test_concurrency_falls_with_length_and_fp8_doubles_it() -> None:
    manager = PluginManager()
    config = load_preset("llama-3.1-8b")
    lengths = [1024, 8192, 131072, 1 << 20]
    auto = concurrency_curve(config, 40 << 30, PlanOptions(), manager, lengths)
    fp8 = concurrency_curve(config, 40 << 30, PlanOptions(kv_cache_dtype="fp8"), manager, lengths)
    assert [length for length, _ in auto] == lengths
    values = [value for _, value in auto]
    assert values[0] == pytest.approx(20479 / 64) and values[2] == pytest.approx(20479 / 8192)
    assert values[3] is None  # 1M tokens need 128 GiB
    assert all(a > b for a, b in pairwise(values[:3]))
    assert fp8[2][1] == pytest.approx(40959 / 8192)
