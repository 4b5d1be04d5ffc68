"""The real engine on kvspec's cache: transformers models, random weights from real configs.

Every layer's K/V (or MLA latent) lives in kvspec's ``materialize()`` views, blocks come from
``KVCacheAllocator`` with prefix caching, and attention reads K/V paged from the block
tables. Greedy outputs must equal transformers' own (its DynamicCache), prefix hits must
skip the prefix's computation, and the hit blocks must really be what the model reads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers_testkit import (
    LONG_PROMPT,
    MODEL_PRESETS,
    NEW_TOKENS,
    PROMPT,
    PROMPT_A,
    PROMPT_B,
    SHARED_PREFIX,
    config_of,
    forward_lengths,
    model_case,
    reference_generate,
)

from kvspec_core.runtime import Request
from kvspec_core.runtime.results import CachedPrefix
from kvspec_transformers import (
    EngineError,
    KVSpecCache,
    MLALatentLayer,
    PagedAttentionLayer,
    TransformersEngine,
    build_model,
)

MODELS = list(MODEL_PRESETS)


def engine_for(name: str) -> TransformersEngine:
    case = model_case(name)
    return TransformersEngine(case.model, kvspec_config=case.config)


# --------------------------------------------------------------------------- identical output
@pytest.mark.parametrize("name", MODELS)
def test_greedy_output_is_token_identical_to_transformers(name: str) -> None:
    engine = engine_for(name)
    result = engine.generate(PROMPT, NEW_TOKENS)
    assert result.token_ids == model_case(name).reference["prompt"]
    assert len(result.token_ids) == NEW_TOKENS
    assert result.cached_tokens == 0 and result.prefill_tokens == len(PROMPT)
    engine.allocator.check_invariants()
    assert engine.allocator.num_running == 0


@pytest.mark.parametrize(
    ("name", "field", "unbounded"),
    [
        ("mistral", "sliding_window", None),
        ("gemma2", "sliding_window", 100_000),
        ("llama4", "attention_chunk_size", 100_000),
    ],
)
def test_the_prompt_crosses_the_local_attention_bound(
    name: str, field: str, unbounded: int | None
) -> None:
    """Without the window / chunk, transformers itself answers differently: the identity
    above really exercises the family's read range, not just full attention."""
    model = build_model(config_of(name, **{field: unbounded}), seed=0)
    assert reference_generate(model, PROMPT) != model_case(name).reference["prompt"]


def test_gemma2_attention_softcapping_is_applied() -> None:
    """Gemma 2's softcap of 50 never binds on a tiny model; at 1.0 it changes transformers'
    tokens, and the paged attention's capped scores give the capped model's tokens."""
    config = config_of("gemma2", attn_logit_softcapping=1.0)
    capped = build_model(config, seed=0)
    expected = reference_generate(capped, PROMPT)
    assert expected != model_case("gemma2").reference["prompt"]
    engine = TransformersEngine(capped, kvspec_config=config)
    assert engine.generate(PROMPT, NEW_TOKENS).token_ids == expected


def test_every_layer_caches_in_kvspec_views() -> None:
    engine = engine_for("gemma2")
    assert isinstance(engine.cache, KVSpecCache)
    assert [type(layer) for layer in engine.cache.layers] == [PagedAttentionLayer] * 4
    kinds = {group.kind for group in engine.plan.groups}
    assert kinds == {"sliding_window", "full_attention"}
    for binding in engine.bindings.values():
        view = engine.views[binding.layer_name]
        assert binding.view is view
        assert view.shape[1:] == (2, 16, 64)  # [blocks, kv heads, tokens, K 32 | V 32]


def test_mla_caches_the_576_wide_latent_not_expanded_kv() -> None:
    engine = engine_for("deepseek_v2")
    assert all(isinstance(layer, MLALatentLayer) for layer in engine.cache.layers)
    for binding in engine.bindings.values():
        assert binding.spec.kind == "mla_attention"
        # one latent per token shared by the heads: kv_lora_rank 512 + qk_rope_head_dim 64
        assert engine.views[binding.layer_name].shape[1:] == (1, 16, 576)


# --------------------------------------------------------------------------- prefix reuse
def engine_after_request_a(name: str) -> tuple[TransformersEngine, CachedPrefix]:
    """A fresh engine that ran request A, and the prefix it has cached for request B."""
    engine = engine_for(name)
    engine.generate(PROMPT_A, NEW_TOKENS, request_id="A")
    hit = engine.allocator.find_cached_prefix(Request("probe", list(PROMPT_B)))
    assert hit.num_tokens == SHARED_PREFIX
    return engine, hit


@pytest.mark.parametrize("name", MODELS)
def test_prefix_hit_computes_only_the_suffix_and_keeps_the_output(name: str) -> None:
    engine, _ = engine_after_request_a(name)
    with forward_lengths(engine.model) as forwards:
        result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == SHARED_PREFIX
    assert result.prefill_tokens == len(PROMPT_B) - SHARED_PREFIX == 10
    # the prefill forward ran the 10 suffix tokens only, then one token per decode step
    assert forwards == [10] + [1] * (NEW_TOKENS - 1)
    assert result.token_ids == model_case(name).reference["b"]
    engine.allocator.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_corrupting_the_hit_blocks_changes_the_output(name: str) -> None:
    """The hit blocks are what B's attention reads: garbage there changes B's tokens."""
    engine, hit = engine_after_request_a(name)
    generator = torch.Generator().manual_seed(5)
    corrupted = 0
    for binding in engine.bindings.values():
        blocks = [block for block in hit.block_ids[binding.group] if block]
        view = engine.views[binding.layer_name]
        for block in blocks:
            view[block] = torch.randn(view[block].shape, generator=generator) * 10
            corrupted += 1
    assert corrupted > 0
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == SHARED_PREFIX
    assert result.token_ids != model_case(name).reference["b"]


def test_without_prefix_caching_nothing_is_reused() -> None:
    case = model_case("llama")
    engine = TransformersEngine(case.model, kvspec_config=case.config, enable_prefix_caching=False)
    engine.generate(PROMPT_A, NEW_TOKENS)
    result = engine.generate(PROMPT_B, NEW_TOKENS)
    assert result.cached_tokens == 0
    assert result.token_ids == case.reference["b"]


# --------------------------------------------------------------------------- clean failures
def test_bad_prompts_are_refused_naming_the_field() -> None:
    engine = engine_for("llama")
    with pytest.raises(EngineError, match="prompt_token_ids is empty"):
        engine.generate([], 4)
    with pytest.raises(EngineError, match=r"prompt_token_ids\[1\]=512 must be a token id"):
        engine.generate([1, 512], 4)
    with pytest.raises(EngineError, match="max_new_tokens=0"):
        engine.generate([1, 2], 0)
    assert engine.allocator.num_running == 0


def test_stop_none_and_numpy_lengths_are_taken_and_bools_refused() -> None:
    """Found in review: stop_token_ids=None raised a bare TypeError, and a numpy integer
    max_new_tokens was refused though numpy prompts are taken."""
    import numpy as np

    engine = engine_for("llama")
    default = engine.generate(PROMPT, 3).token_ids
    assert engine.generate(PROMPT, np.int64(3), stop_token_ids=None).token_ids == default
    for refused in (True, np.bool_(True), 2.0, "3"):
        with pytest.raises(EngineError, match="max_new_tokens="):
            engine.generate(PROMPT, refused)  # type: ignore[arg-type]
    assert engine.allocator.num_running == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "int4_per_token_head", "nvfp4"])
def test_kv_dtypes_with_scales_or_packed_values_are_refused_at_start(kv_cache_dtype: str) -> None:
    """Found in review: the engine started on such a plan, and its first forward died on a
    torch shape error (the adapters store K/V as they are, never quantised)."""
    from kvspec_core.errors import ConfigError
    from kvspec_core.plugins.layer_config import PlanOptions

    case = model_case("llama")
    with pytest.raises(ConfigError, match=f"quant mode '{kv_cache_dtype}' stores scales"):
        TransformersEngine(
            case.model,
            kvspec_config=case.config,
            options=PlanOptions(kv_cache_dtype=kv_cache_dtype),
        )


def test_an_encoder_decoder_model_is_refused_at_start() -> None:
    """Found in review: Whisper's decoder self-attention and cross-attention layers share an
    index; the cross-attention binding replaced the self-attention one, and generate died
    inside the encoder."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=512, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, num_mel_bins=80, max_source_positions=64,
        max_target_positions=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1,
    )  # fmt: skip
    model = WhisperForConditionalGeneration(config).eval()
    with pytest.raises(EngineError, match="encoder_attn is cross_attention"):
        TransformersEngine(model)


def test_k_v_of_other_heads_than_planned_are_refused_naming_the_layer() -> None:
    """Found in review: K/V of other heads than the plan's died on a torch shape error at
    the first write (then: Falcon's new architecture, now refused at start, below). Here a
    kvspec_config planning 8 KV heads for a Llama whose layers compute 2."""
    from kvspec_core.errors import ConfigError

    case = model_case("llama")
    engine = TransformersEngine(
        case.model, kvspec_config={**case.config, "num_key_value_heads": 8}, max_model_len=96
    )
    with pytest.raises(ConfigError, match="wrote cells of 2 heads x 32 values, but its "):
        engine.generate([1, 2, 3], 2)


#: Causal LMs whose attention is their own code, not transformers' AttentionInterface:
#: ``set_attn_implementation`` only logs a warning and they keep their attention.
OWN_ATTENTION = {
    "bloom": {},
    "mpt": {},
    "xglm": {},
    "gpt_neox_japanese": {},
    "falcon": {"new_decoder_architecture": False},
    "falcon_new": {"model_type": "falcon", "new_decoder_architecture": True, "num_kv_heads": 2},
}


@pytest.mark.parametrize("case_name", list(OWN_ATTENTION))
def test_a_model_whose_attention_bypasses_the_attention_interface_is_refused_at_start(
    case_name: str, tmp_path: Path
) -> None:
    """Found in review: these models started, kept their own attention (over the step's
    K/V alone) and crashed inside transformers at the first generate (Falcon's new
    architecture: at the cache's first write). Now refused at start naming the class; the
    disk tier's files are removed and the model keeps its attention implementation."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(OWN_ATTENTION[case_name])
    model_type = fields.pop("model_type", case_name)
    config = AutoConfig.for_model(
        model_type, vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        n_embd=64, n_layer=2, n_head=4, d_model=64, intermediate_size=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, **fields,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32).eval()
    before = model.config._attn_implementation
    with pytest.raises(
        EngineError,
        match=rf"{type(model).__name__} computes attention in its own code, not through "
        "transformers' AttentionInterface",
    ):
        TransformersEngine(
            model,
            max_model_len=96,
            host_offload_bytes=1 << 20,
            disk_offload_bytes=1 << 20,
            disk_path=str(tmp_path),
        )
    assert os.listdir(tmp_path) == []
    assert model.config._attn_implementation == before


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("tensor_parallel_size", 2),
        ("decode_context_parallel_size", 2),
    ],
)
@pytest.mark.parametrize("name", ["llama", "deepseek_v2"])
def test_more_than_one_rank_is_refused_at_start(name: str, field: str, value: int) -> None:
    """Found in review: tensor_parallel_size=2 planned one rank's share of Llama's KV heads
    and died at the first write naming the heads; decode_context_parallel_size=2 was refused
    by the planner as not dividing TP, and with TP=DCP=2 DeepSeek's first step died in the
    slot mapping. The engine runs the whole model as one rank: refused naming the field."""
    from kvspec_core.plugins.layer_config import PlanOptions

    case = model_case(name)
    options = PlanOptions(**{field: value})
    with pytest.raises(EngineError, match=rf"options.{field}={value}: the engine runs the whole"):
        TransformersEngine(case.model, kvspec_config=case.config, options=options)


def test_a_request_longer_than_max_model_len_is_refused_and_freed() -> None:
    case = model_case("llama")
    engine = TransformersEngine(case.model, kvspec_config=case.config, max_model_len=32)
    with pytest.raises(EngineError, match="max_model_len=32"):
        engine.generate(PROMPT, 4)
    assert engine.allocator.num_running == 0
    engine.allocator.check_invariants()


def test_the_window_frees_blocks_while_decoding_and_the_output_holds() -> None:
    """Mistral's window of 24: decoding past an 80-token prompt, the allocator nulls the
    blocks below the window, and the engine reads only what the spec says a query reads."""
    engine = engine_for("mistral")
    tables: list[tuple[int, ...]] = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args: tables.append(engine.cache.current_step.block_tables[0])
    )
    try:
        result = engine.generate(LONG_PROMPT, NEW_TOKENS)
    finally:
        hook.remove()
    assert result.token_ids == model_case("mistral").reference["long"]
    assert 0 not in tables[0]  # the prefill step holds every block it writes
    assert tables[-1][:3] == (0, 0, 0)  # positions 0..47 lie below 87 - 24 + 1


@pytest.mark.parametrize("name", ["llama4", "deepseek_v2"])
def test_the_model_config_itself_plans_the_same_engine(name: str) -> None:
    """Without ``kvspec_config`` kvspec plans ``model.config.to_dict()``: same groups, same
    tokens (the chunked and MLA layers are recognised from transformers' own config)."""
    case = model_case(name)
    from_dict = engine_for(name)
    from_model = TransformersEngine(case.model)
    assert [g.kind for g in from_model.plan.groups] == [g.kind for g in from_dict.plan.groups]
    assert from_model.generate(PROMPT, NEW_TOKENS).token_ids == case.reference["prompt"]
