"""``--kv-cache-dtype`` of ``kvspec plan`` is read by one reader
(:func:`kvspec_core.cli.arguments.kv_cache_dtypes`), for the plan, the ``--gpu`` TP search
and the ``--plot`` curves alike."""

from __future__ import annotations

import argparse
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from plan_cli_testkit import plan_json

from kvspec_core.cli.arguments import DEFAULT_KV_CACHE_DTYPE, kv_cache_dtypes
from kvspec_core.cli.main import build_parser
from kvspec_core.plugins.manager import PluginManager

DTYPE_NAMES = st.sampled_from(["auto", "fp8", "fp8_e5m2", "bfloat16", "float16", "int8", "x", ""])


def _parsed_plan(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["plan", "llama-3.1-8b", "--memory", "40GiB", *argv])


@given(st.lists(DTYPE_NAMES, max_size=6))
def test_the_values_given_in_order_each_once_else_auto(names: list[str]) -> None:
    argv = [part for name in names for part in ("--kv-cache-dtype", name)]
    dtypes = kv_cache_dtypes(_parsed_plan(*argv))
    assert dtypes == (list(dict.fromkeys(names)) or [DEFAULT_KV_CACHE_DTYPE])
    assert dtypes[0] == (names[0] if names else DEFAULT_KV_CACHE_DTYPE)  # what the plan uses


@pytest.mark.parametrize("name", ["fp8", ""])
def test_a_single_value_is_one_dtype(name: str) -> None:
    # The option as ``kvspec simulate`` parses it (not repeatable): one string. An empty one
    # is given, as an empty repeated value is (refused later as an unknown dtype), not auto.
    simulate = build_parser().parse_args(
        ["simulate", "llama-3.1-8b", "--memory", "40GiB", "--kv-cache-dtype", name]
    )
    assert simulate.kv_cache_dtype == name
    assert kv_cache_dtypes(simulate) == [name]
    assert kv_cache_dtypes(_parsed_plan("--kv-cache-dtype", name)) == [name]


def test_plan_reads_a_single_value_as_the_gpu_search_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The two readers disagreed on one input: a single string value, as a non-repeatable
    option stores it. The ``--gpu`` TP search read it as one dtype; the plan split it into
    characters and planned under ``"f"`` (refused: unknown KV dtype). One dtype is right."""
    args = _parsed_plan("--json")
    args.kv_cache_dtype = "fp8"
    assert args.handler(args, PluginManager()) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == plan_json(
        capsys, "llama-3.1-8b", "--memory", "40GiB", "--kv-cache-dtype", "fp8"
    )
    assert report["kv_cache_dtype"] == "fp8"


def test_several_dtypes_without_plot_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # Found by review: "--kv-cache-dtype fp8 --kv-cache-dtype fp9" planned fp8 with exit 0;
    # only --plot reads every value.
    from plan_cli_testkit import fails

    def twice(first: str, second: str) -> list[str]:
        return ["llama-3.1-8b", "--memory", "40GiB"] + [
            part for name in (first, second) for part in ("--kv-cache-dtype", name)
        ]

    err = fails(capsys, *twice("fp8", "fp9"))
    assert "2 values (fp8, fp9)" in err and "--plot" in err
    # The same value twice is one dtype.
    assert plan_json(capsys, *twice("fp8", "fp8"))["kv_cache_dtype"] == "fp8"
