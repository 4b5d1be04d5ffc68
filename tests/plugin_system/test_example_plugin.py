"""The README's example plugin, really installed (pip --target) and loaded from outside the repo."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvspec_core import AttentionShape, LayerConfig, PlanOptions, PluginManager, SizingContext
from kvspec_core.errors import ConfigError
from kvspec_core.runtime import KVCacheAllocator, Request
from kvspec_core.testing import check_spec_protocol

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "kvspec-streaming"


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return target


def streaming_layer(**config) -> LayerConfig:
    return LayerConfig(
        index=3,
        name="model.layers.3",
        layer_type="streaming_attention",
        config=config,
        options=PlanOptions(block_size=16),
        model_dtype=torch.bfloat16,
        attention=AttentionShape(
            num_kv_heads=8, total_kv_heads=8, head_size=128, head_size_v=128, dtype=torch.bfloat16
        ),
    )


def test_installed_example_plugin_loads_and_plans(
    installed_example: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(installed_example))
    monkeypatch.delitem(sys.modules, "kvspec_streaming", raising=False)
    manager = PluginManager()
    manager.load_entry_points({"KVSPEC_PLUGINS": "streaming"})
    [info] = [p for p in manager.plugins if p.name == "streaming"]
    assert info.distribution == "kvspec-streaming" and info.spec_kinds == ("streaming_attention",)
    [(owner, spec)] = manager.layer_specs(
        streaming_layer(streaming_sink_tokens=4, streaming_recent_tokens=1024)
    )
    assert owner == "streaming"
    ctx = SizingContext(max_model_len=131072, max_in_flight_tokens=2048)
    # cdiv(1023 + 2048, 16) window blocks + 1 for a window starting mid-block (the sink
    # tokens are the engine's, beside the paged cache).
    assert spec.max_blocks_per_request(ctx) == 192 + 1
    check_spec_protocol(spec, manager)
    with pytest.raises(ConfigError, match=r"model.layers.3.*streaming_sink_tokens"):
        manager.layer_specs(streaming_layer())
    # Its rules free what its sizing leaves out: one request, prefilled and decoded in steps
    # of max_in_flight_tokens, reaches max_model_len within its admission cap (found in
    # review: without rules it got full attention's and stopped near 1,568 tokens).
    small = SizingContext(max_model_len=8192, max_in_flight_tokens=512)
    allocator = KVCacheAllocator(
        [spec], 4 * spec.max_blocks_per_request(small), small, manager=manager
    )
    request = Request("r", list(range(8192)))
    for _ in range(8192 // 512):
        assert allocator.allocate_slots(request, 512)
    held = [block for block in allocator.block_ids("r")[0] if block != 0]
    assert len(held) <= spec.max_blocks_per_request(small)
    allocator.free("r")
    allocator.check_invariants()


def test_installed_example_plugin_ships_its_license(installed_example: Path) -> None:
    [dist_info] = installed_example.glob("kvspec_streaming-*.dist-info")
    metadata = (dist_info / "METADATA").read_text()
    assert "License: Apache-2.0" in metadata.splitlines()
    assert "License-File: LICENSE" in metadata.splitlines()
    root_license = (EXAMPLE.parents[1] / "LICENSE").read_bytes()
    assert (dist_info / "licenses" / "LICENSE").read_bytes() == root_license
