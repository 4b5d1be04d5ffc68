"""Cross-layer KV sharing on the engine: Gemma-3n's last ``num_kv_shared_layers`` layers
compute no K/V and attend over an earlier layer's (transformers' ``is_kv_shared_layer``).

The engine binds each reader to its source's view and block table; the greedy output is
token-identical to transformers' own ``generate`` (a tiny random-weight Gemma-3n built from
``Gemma3nTextConfig``, transformers' defaults shrunk), with and without a prefix hit. A plan
whose sharing is not the model's is refused: a reader the plan gives a cache of its own would
attend over blocks nothing writes."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import transformers
from transformers_testkit import (
    PROMPT,
    PROMPT_A,
    PROMPT_B,
    SHARED_PREFIX,
    reference_generate,
    token_ids,
)

from kvspec_core.errors import ConfigError
from kvspec_core.specs import FullAttentionSpec
from kvspec_transformers import TransformersEngine
from kvspec_transformers.errors import EngineError
from kvspec_transformers.layer_adapters import LayerBinding, PagedAttentionLayer
from kvspec_transformers.model_layout import check_sharing_against_model, model_kv_sources

#: Ten layers (every fifth full attention, transformers' pattern), the last four reading:
#: sliding readers 6, 7, 8 read layer 5, the full reader 9 reads layer 4.
TINY = dict(
    vocab_size=512,
    vocab_size_per_layer_input=512,
    hidden_size=32,
    hidden_size_per_layer_input=8,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    laurel_rank=4,
    max_position_embeddings=256,
    sliding_window=8,
    num_hidden_layers=10,
    initializer_range=0.1,
)
READERS = {6: 5, 7: 5, 8: 5, 9: 4}


def gemma3n(num_kv_shared_layers: int) -> Any:
    """A fresh model (an engine switches its attention to the paged one), same weights."""
    torch.manual_seed(0)
    config = transformers.Gemma3nTextConfig(**TINY, num_kv_shared_layers=num_kv_shared_layers)
    return transformers.Gemma3nForCausalLM(config).eval()


@functools.cache
def reference(num_kv_shared_layers: int, prompt: tuple[int, ...]) -> tuple[int, ...]:
    return reference_generate(gemma3n(num_kv_shared_layers), prompt)


def engine(model: Any, **kwargs: Any) -> TransformersEngine:
    return TransformersEngine(model, max_model_len=128, budget_bytes=1 << 22, **kwargs)


def test_the_model_says_which_layers_read_whose_cache() -> None:
    assert model_kv_sources(gemma3n(4)) == READERS
    assert model_kv_sources(gemma3n(0)) == {}


def test_readers_read_their_source_blocks_and_the_output_is_transformers() -> None:
    expected = {tuple(p): reference(4, tuple(p)) for p in (PROMPT, PROMPT_A, PROMPT_B)}
    run = engine(gemma3n(4))
    assert {
        (int(r.rsplit(".", 1)[1]), int(s.rsplit(".", 1)[1])) for r, s in run.plan.kv_sharing
    } == set(READERS.items())
    # The readers hold no blocks: their views are their sources' bytes.
    for reader, source in run.plan.kv_sharing:
        assert reader in run.plan.memoryless_layers
        assert run.views[reader].data_ptr() == run.views[source].data_ptr()
    assert run.generate(PROMPT, max_new_tokens=8).token_ids == expected[tuple(PROMPT)]
    assert run.generate(PROMPT_A, max_new_tokens=8).token_ids == expected[tuple(PROMPT_A)]
    hit = run.generate(PROMPT_B, max_new_tokens=8)
    assert hit.cached_tokens == SHARED_PREFIX
    assert hit.token_ids == expected[tuple(PROMPT_B)]


def test_the_outputs_differ_without_sharing() -> None:
    """The control: the model with no readers answers otherwise, so the identity above
    depends on the readers reading their sources' K/V."""
    assert reference(0, tuple(PROMPT)) != reference(4, tuple(PROMPT))


def test_a_plan_hiding_the_model_sharing_is_refused_naming_the_layer() -> None:
    model = gemma3n(4)
    hidden = {**model.config.to_dict(), "dtype": "float32", "num_kv_shared_layers": 0}
    with pytest.raises(EngineError) as error:
        engine(model, kvspec_config=hidden)
    message = str(error.value)
    assert message.startswith("layer model.layers.6: the model attends over the K/V of layer")
    assert "model.layers.5" in message and "num_kv_shared_layers=4" in message
    assert "keeps a cache of its own for it" in message and "without kvspec_config" in message


def test_a_plan_sharing_what_the_model_computes_is_refused() -> None:
    model = gemma3n(0)
    shared = {**model.config.to_dict(), "dtype": "float32", "num_kv_shared_layers": 4}
    shared.pop("kv_sharing_modes", None)
    with pytest.raises(
        EngineError,
        match=r"layer model\.layers\.6: the kvspec plan has it read "
        r"layer model\.layers\.5's cache \(plan\.kv_sharing\) but the model computes",
    ):
        engine(model, kvspec_config=shared)


def test_a_reader_of_another_source_is_refused() -> None:
    names = {index: f"model.layers.{index}" for index in range(10)}
    with pytest.raises(
        EngineError,
        match=r"layer model\.layers\.9: the model attends over the "
        r"K/V of layer model\.layers\.4 but the kvspec plan has it read layer "
        r"model\.layers\.5's cache",
    ):
        check_sharing_against_model(READERS, {**READERS, 9: 5}, names)
    with pytest.raises(EngineError, match=r"does not say whose it reads"):
        check_sharing_against_model({6: None}, {6: 5}, names)
    check_sharing_against_model(READERS, dict(READERS), names)  # agreeing: no error


def test_a_reader_adapter_refuses_a_write() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    view = torch.zeros(4, 1, 16, 32)
    binding = LayerBinding(
        layer_index=9,
        layer_name="model.layers.9",
        group=0,
        spec=spec,
        view=view,
        source_layer="model.layers.4",
    )
    states = torch.ones(1, 1, 2, 16)
    with pytest.raises(ConfigError, match=r"layer model\.layers\.9 reads layer model\.layers\.4"):
        PagedAttentionLayer(binding).update(states, states, 9)
    assert not view.any()


def test_readers_read_a_prefix_loaded_back_from_the_host_tier() -> None:
    """A's blocks leave the device for a host tier (three unrelated requests push them out of
    60 device blocks of 2 KiB); B loads the 48-token prefix back into the sources' blocks and
    the readers attend over them: the output is transformers'. (The model's config names no
    dtype; the engine plans the float32 parameters' dtype, not kvspec's bfloat16 default.)"""
    run = TransformersEngine(
        gemma3n(4), max_model_len=96, budget_bytes=120 << 10, host_offload_bytes=80 << 10
    )
    assert [pool.block_bytes for pool in run.plan.pools] == [2048]
    run.generate(PROMPT_A, max_new_tokens=8)
    for seed in range(3):
        run.generate(token_ids(57, seed=100 + seed), max_new_tokens=8)
    hit = run.generate(PROMPT_B, max_new_tokens=8)
    assert hit.cached_tokens_by_tier == {"device": 0, "host": SHARED_PREFIX}
    assert hit.token_ids == reference(4, tuple(PROMPT_B))
    assert run.transfers.failed == 0
    run.allocator.check_invariants()


def test_the_fix_does_not_say_what_was_done() -> None:
    """A model that reads a shared cache where kvspec's reading of its own config sees none
    (an ingestion gap, mimicked by marking layer 5 a reader of layer 3): the fix cannot be
    "plan the model's own config", which the engine did."""
    model = gemma3n(0)
    model.model.layers[3].self_attn.store_full_length_kv = True
    model.model.layers[5].self_attn.is_kv_shared_layer = True
    with pytest.raises(EngineError) as error:
        engine(model)
    message = str(error.value)
    assert message.startswith(
        "layer model.layers.5: the model attends over the K/V of layer model.layers.3"
    )
    assert "kvspec planned model.config itself" in message
    assert "without kvspec_config" not in message
