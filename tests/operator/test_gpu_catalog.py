"""The GPU catalog and the overhead table are data: every entry valid and sourced."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from kvspec_core.deployment.gpus import MIB, find_gpu, gpu_catalog
from kvspec_core.deployment.overheads import GIB, estimate_overheads, overhead_table
from kvspec_core.errors import ConfigError


def test_every_catalog_gpu_is_valid_and_sourced() -> None:
    raw = json.loads(resources.files("kvspec_core.deployment").joinpath("gpus.json").read_text())
    catalog = gpu_catalog()
    assert set(catalog) == set(raw["gpus"]) and len(catalog) >= 5
    for name, gpu in catalog.items():
        assert name == name.lower() and " " not in name
        assert gpu.memory_bytes == raw["gpus"][name]["memory_mib"] * MIB
        assert "nvidia-smi" in gpu.source and gpu.description


def test_catalog_figures_are_what_nvidia_smi_reports_not_the_marketing_size() -> None:
    # An H100 "80GB" reports 81,559 MiB: 79.65 GiB, neither 80 GB nor 80 GiB.
    assert find_gpu("h100-80gb").memory_bytes == 81_559 * 2**20
    assert find_gpu("A100-40GB").memory_bytes == 40_960 * 2**20
    assert find_gpu("l4").memory_bytes == 23_034 * 2**20


def test_an_unknown_gpu_is_refused_listing_the_catalog_and_the_fix() -> None:
    with pytest.raises(ConfigError) as error:
        find_gpu("h100")
    message = str(error.value)
    assert "'h100'" in message and "h100-80gb" in message and "--gpu-memory" in message


def test_the_overhead_table_is_sourced_and_plausible() -> None:
    table = overhead_table()
    assert "llm-d-planner 0.3.3" in table["source"] and "vLLM" in table["about"]
    figures = [*table["activation_gib"].values(), *table["activation_base_gib"].values()]
    figures += table["non_torch_gib"].values()
    assert all(0 < figure < 8 for figure in figures)


def test_overheads_follow_the_architecture_then_the_kind_then_the_parallelism() -> None:
    llama = estimate_overheads({"architectures": ["LlamaForCausalLM"]}, tp=1, pp=1)
    assert llama.activation_bytes == round(1.89 * GIB)
    assert llama.non_torch_bytes == round(0.27 * GIB)
    moe = estimate_overheads({"architectures": ["JambaForCausalLM"], "num_experts": 16}, 2, 1)
    assert moe.activation_bytes == round(2.5 * GIB) and moe.non_torch_bytes == round(2.1 * GIB)
    assert "moe base" in moe.basis
    dense = estimate_overheads({"architectures": ["NewForCausalLM"]}, tp=1, pp=2)
    assert dense.activation_bytes == round(2.0 * GIB)
    assert dense.non_torch_bytes == round(0.07 * GIB)


def test_each_catalog_figure_cites_where_it_was_read_unless_said_unpinned() -> None:
    raw = json.loads(resources.files("kvspec_core.deployment").joinpath("gpus.json").read_text())
    unpinned = {"h200", "b200"}  # the catalog's "about" says these are not pinned here
    assert all(name.upper() in raw["about"] for name in unpinned)
    for name, gpu in gpu_catalog().items():
        assert (" github.com/" in gpu.source or "(github.com/" in gpu.source) != (
            name in unpinned
        ), name
        assert f"{raw['gpus'][name]['memory_mib']}MiB" in gpu.source
