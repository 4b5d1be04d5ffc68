"""State-layer models on kvspec's cache: Qwen3-Next (gated delta-net + full attention) and
Bamba (Mamba-2 + attention), random weights from their real configs, ``align`` mode.

Every linear-attention layer's conv window and recurrent state live in its kvspec block
(``MambaSpec.state_views``), every attention layer's K/V in its paged view. Greedy outputs
must equal transformers' own; a prefix hit must resume from the state saved at a block
boundary (computing only the suffix) and the hit state block must be what the model reads.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from kvspec_core.errors import ConfigError
from kvspec_core.models.catalog import load_preset
from kvspec_core.runtime import Request

# The state family plugin is optional for kvspec-transformers; without it these tests skip.
pytest.importorskip("kvspec_mamba", reason="kvspec-mamba (the state family) is not installed")
from transformers_testkit import (
    NEW_TOKENS,
    PREFIX,
    PROMPT,
    PROMPT_A,
    PROMPT_B,
    SHARED_PREFIX,
    fail_on_call,
    reference_generate,
    token_ids,
)

from kvspec_mamba import MambaSpec, prefill_step_ends
from kvspec_transformers import (
    PagedAttentionLayer,
    TransformersEngine,
    build_model,
    read_config,
    shrink_config,
)
from kvspec_transformers.state_layers import StateLayer

#: Bamba-9B's published config (ibm-ai-platform/Bamba-9B), copied under tests/data.
BAMBA_9B = Path(__file__).parent / "data" / "ibm-ai-platform__Bamba-9B.json"
#: Real configs: Qwen3-Next-80B-A3B-Thinking from kvspec's bundled preset (the Hugging Face
#: config.json, byte for byte), Bamba-9B from tests/data.
CONFIGS = {
    "qwen3_next": lambda: load_preset("qwen3-next-80b"),
    "bamba": lambda: read_config(BAMBA_9B),
}
#: The mixer module of a state layer in each model.
MIXERS = {"qwen3_next": "linear_attn", "bamba": "mamba"}
MODELS = list(CONFIGS)

#: The shared prefix and one token: the hit state is the one the last prompt token reads
#: (with random weights, Bamba's Mamba-2 decays an old state within a few tokens).
PROMPT_C = PREFIX + token_ids(1, seed=4)


@functools.cache
def case(name: str) -> tuple[dict[str, Any], torch.nn.Module, dict[str, tuple[int, ...]]]:
    """Shrunk config, model and transformers' reference outputs (computed before any engine
    switches the model to the paged attention)."""
    config = shrink_config(CONFIGS[name]())
    model = build_model(config, seed=0)
    reference = {
        "prompt": reference_generate(model, PROMPT),
        "b": reference_generate(model, PROMPT_B),
        "c": reference_generate(model, PROMPT_C),
    }
    return config, model, reference


def engine_for(name: str) -> TransformersEngine:
    config, model, _ = case(name)
    return TransformersEngine(model, kvspec_config=config)


def state_layers(engine: TransformersEngine) -> list[StateLayer]:
    return [layer for layer in engine.cache.layers if isinstance(layer, StateLayer)]


def hit_state_blocks(engine: TransformersEngine, prompt: Sequence[int]) -> dict[str, int]:
    """Per state layer, the block a request for ``prompt`` would resume its state from."""
    prefix = engine.allocator.find_cached_prefix(Request("peek", list(prompt)))
    blocks = {}
    for layer in state_layers(engine):
        binding = layer.binding
        column = layer.spec.state_columns(
            prefix.num_tokens, len(prompt) - prefix.num_tokens, engine.plan.context.mamba_cache_mode
        ).read
        assert column is not None
        blocks[binding.layer_name] = prefix.block_ids[binding.group][column]
    return blocks


@contextmanager
def forward_tokens(model: torch.nn.Module) -> Iterator[list[int]]:
    """Tokens of each forward ``model`` runs (an embedding hook)."""
    counts: list[int] = []
    handle = model.get_input_embeddings().register_forward_pre_hook(
        lambda module, args: counts.append(int(args[0].numel()))
    )
    try:
        yield counts
    finally:
        handle.remove()


# --------------------------------------------------------------------------- identical output
@pytest.mark.parametrize("name", MODELS)
def test_greedy_output_is_token_identical_to_transformers(name: str) -> None:
    engine = engine_for(name)
    result = engine.generate(PROMPT, NEW_TOKENS)
    assert result.token_ids == case(name)[2]["prompt"]
    assert result.cached_tokens == 0 and result.prefill_tokens == len(PROMPT)
    engine.allocator.check_invariants()


@pytest.mark.parametrize("name", MODELS)
def test_state_and_kv_live_in_kvspec_blocks(name: str) -> None:
    """Every layer is a kvspec adapter (state layers on Mamba groups in align mode); during
    the forward the states the mixer reads are views into the state pool's buffer."""
    engine = engine_for(name)
    _, model, _ = case(name)
    assert engine.plan.context.mamba_cache_mode == "align"
    layer_types = model.config.layer_types
    expected = [
        StateLayer if kind == "linear_attention" else PagedAttentionLayer for kind in layer_types
    ]
    assert [type(layer) for layer in engine.cache.layers] == expected
    assert "linear_attention" in layer_types and "full_attention" in layer_types
    pools = {engine.plan.groups[layer.binding.group].pool for layer in state_layers(engine)}
    (pool,) = pools
    buffer = engine.buffers.buffers[pool]
    inside: list[bool] = []

    def check(module: torch.nn.Module, args: Any) -> None:
        layer = engine.cache.layers[module.layer_idx]
        for state in (layer.conv_states[0], layer.recurrent_states[0]):
            offset = state.data_ptr() - buffer.data_ptr()
            inside.append(0 <= offset < buffer.numel())

    handles = [
        getattr(block, MIXERS[name]).register_forward_pre_hook(check)
        for block in model.model.layers
        if hasattr(block, MIXERS[name])
    ]
    try:
        engine.generate(PROMPT, 2)
    finally:
        for handle in handles:
            handle.remove()
    assert inside and all(inside)


# --------------------------------------------------------------------------- prefix reuse
@pytest.mark.parametrize("name", MODELS)
def test_prefix_hit_resumes_from_the_checkpointed_state(name: str) -> None:
    engine = engine_for(name)
    block = engine.plan.groups[state_layers(engine)[0].binding.group].spec.block_size
    assert prefill_step_ends(0, len(PROMPT_A), block) == (SHARED_PREFIX, len(PROMPT_A))
    model = case(name)[1]
    with forward_tokens(model) as counts:
        engine.generate(PROMPT_A, 1)
    # A's prefill ended a step on the boundary at 48: the state there was saved.
    assert counts == [SHARED_PREFIX, len(PROMPT_A) - SHARED_PREFIX]
    hit_blocks = hit_state_blocks(engine, PROMPT_B)
    saved = {layer: engine.views[layer][block].clone() for layer, block in hit_blocks.items()}
    with forward_tokens(model) as counts:
        result = engine.generate(PROMPT_B, NEW_TOKENS)
    assert result.cached_tokens == SHARED_PREFIX
    assert result.prefill_tokens == len(PROMPT_B) - SHARED_PREFIX
    assert counts == [len(PROMPT_B) - SHARED_PREFIX] + [1] * (NEW_TOKENS - 1)
    assert result.token_ids == case(name)[2]["b"]
    # The cached state was read, never written: B's state went to blocks of its own.
    for layer, block in hit_blocks.items():
        assert torch.equal(engine.views[layer][block], saved[layer])
    again = engine.generate(PROMPT_B, NEW_TOKENS)
    assert again.cached_tokens == SHARED_PREFIX and again.token_ids == result.token_ids


@pytest.mark.parametrize("name", MODELS)
def test_corrupting_the_hit_state_block_changes_the_output(name: str) -> None:
    engine = engine_for(name)
    engine.generate(PROMPT_A, 1)
    intact = engine.generate(PROMPT_C, NEW_TOKENS)
    assert intact.cached_tokens == SHARED_PREFIX and intact.token_ids == case(name)[2]["c"]
    generator = torch.Generator().manual_seed(5)
    hit_blocks = hit_state_blocks(engine, PROMPT_C)
    for layer in state_layers(engine):
        block = hit_blocks[layer.binding.layer_name]
        for state in layer.spec.state_views(layer.binding.view, block):
            state.copy_(torch.randn(state.shape, generator=generator) * 4)
    result = engine.generate(PROMPT_C, NEW_TOKENS)
    assert result.cached_tokens == SHARED_PREFIX
    assert result.token_ids != case(name)[2]["c"]


def test_decode_steps_save_states_a_continuation_resumes_from() -> None:
    """Decoding one token per step ends a step on every block boundary: a follow-up turn
    (prompt + answer + new tokens) resumes from the state saved while decoding."""
    config = case("qwen3_next")[0]
    engine = engine_for("qwen3_next")
    prompt = token_ids(30, seed=6)
    first = engine.generate(prompt, 4)  # computes 30 + 3 tokens: the boundary 32 is saved
    follow_up = prompt + list(first.token_ids) + token_ids(2, seed=7)
    result = engine.generate(follow_up, NEW_TOKENS)
    assert result.cached_tokens == 32 and result.prefill_tokens == len(follow_up) - 32
    # The engine switched the shared model's attention; the same seed rebuilds its weights.
    assert result.token_ids == reference_generate(build_model(config, seed=0), follow_up)


def test_a_state_spec_without_a_conv_window_is_refused() -> None:
    engine = engine_for("bamba")
    binding = state_layers(engine)[0].binding
    lone = MambaSpec(
        block_size=16, shapes=((4, 16, 16),), dtypes=(torch.float32,), mamba_type="linear_attention"
    )
    with pytest.raises(ConfigError, match="conv window plus a recurrent state"):
        StateLayer(attrs.evolve(binding, spec=lone))


def test_a_shared_system_prompt_gets_a_checkpoint_the_next_request_resumes_from() -> None:
    """A saved its state only at 96 (the boundary before its last token), inside no other
    prompt: B, sharing A's first 70 tokens, gets no hit but ``checkpoint_at`` 64, where the
    engine ends a prefill step and saves the state; C, sharing the same 70, resumes at 64."""
    config = case("bamba")[0]
    engine = engine_for("bamba")
    system = token_ids(70, seed=8)
    engine.generate(system + token_ids(30, seed=9), 1)
    b_prompt = system + token_ids(20, seed=10)
    assert engine.allocator.find_cached_prefix(Request("peek", b_prompt)).checkpoint_at == 64
    assert engine.generate(b_prompt, 1).cached_tokens == 0
    c_prompt = system + token_ids(15, seed=11)
    result = engine.generate(c_prompt, NEW_TOKENS)
    assert result.cached_tokens == 64 and result.prefill_tokens == len(c_prompt) - 64
    # The engine switched the shared model's attention; the same seed rebuilds its weights.
    assert result.token_ids == reference_generate(build_model(config, seed=0), c_prompt)


@pytest.mark.parametrize("name", MODELS)
def test_a_failed_prefill_step_keeps_only_the_states_it_saved(name: str) -> None:
    """A 65-token prefill runs as steps of 64 and 1; the allocation of the first cached
    four attention blocks and the state at 64, and its forward raises half way: none may be
    hit. Then A's prefill (steps of 48 and 9) fails in its second step: the state saved at
    48 is whole and stays findable, and B resumes there as transformers answers."""
    config = case(name)[0]
    model = build_model(config, seed=0)
    long_prompt = PREFIX + token_ids(17, seed=12)
    expected = {
        "long": reference_generate(model, long_prompt),
        "b": reference_generate(model, PROMPT_B),
    }
    engine = TransformersEngine(model, kvspec_config=config)
    for prompt, call, kept in ((long_prompt, 1, 0), (PROMPT_A, 2, SHARED_PREFIX)):
        handle = fail_on_call(model, 2, call)
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.generate(prompt, NEW_TOKENS)
        handle.remove()
        engine.allocator.check_invariants()
        assert engine.allocator.find_cached_prefix(Request("peek", prompt)).num_tokens == kept
    result = engine.generate(PROMPT_B, NEW_TOKENS)
    assert result.cached_tokens == SHARED_PREFIX
    assert result.token_ids == expected["b"]
    assert engine.generate(long_prompt, NEW_TOKENS).token_ids == expected["long"]


# --------------------------------------------------------------------------- offload tiers
#: Bytes of one block of each pool: (state pool, attention pool).
POOL_BLOCK_BYTES = {"qwen3_next": (5632, 8192), "bamba": (10112, 4096)}
#: Bytes of one block of each pool, summed (a tier's budget per block of each pool).
BLOCK_BYTES = {name: sum(sizes) for name, sizes in POOL_BLOCK_BYTES.items()}
#: Device blocks per pool: one request's 6 states (the planner sizes states for whole
#: requests) beside the null block, and 10 attention blocks (a few requests' worth).
DEVICE_BLOCKS = [7, 10]


def device_budget(name: str) -> int:
    """The device budget that plans DEVICE_BLOCKS."""
    return sum(n * size for n, size in zip(DEVICE_BLOCKS, POOL_BLOCK_BYTES[name], strict=True))


def tiered_engine(name: str, disk_dir: Path | None = None) -> TransformersEngine:
    """DEVICE_BLOCKS on the device, a host tier of 40 blocks per pool, or of 6 with a disk
    tier of 40 below it."""
    config, model, _ = case(name)
    block = BLOCK_BYTES[name]
    engine = TransformersEngine(
        model,
        kvspec_config=config,
        max_model_len=96,
        budget_bytes=device_budget(name),
        host_offload_bytes=(40 if disk_dir is None else 6) * block,
        disk_offload_bytes=None if disk_dir is None else 40 * block,
        disk_path=None if disk_dir is None else str(disk_dir),
    )
    assert [pool.num_blocks for pool in engine.plan.pools] == DEVICE_BLOCKS
    return engine


def evict_prefix_of_a(engine: TransformersEngine, prompt: Sequence[int]) -> Any:
    """Run A and three unrelated requests; the prefix ``prompt`` would find afterwards: all
    48 tokens, from the offload tiers only."""
    engine.generate(PROMPT_A, NEW_TOKENS)
    for seed in range(3):
        engine.generate(token_ids(57, seed=100 + seed), NEW_TOKENS)
    hit = engine.allocator.find_cached_prefix(Request("probe", list(prompt)))
    assert hit.num_tokens == SHARED_PREFIX
    assert hit.tokens_by_tier[0] == 0
    return hit


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tiers", ["host", "host+disk"])
def test_a_checkpointed_state_offloaded_to_the_tiers_is_resumed_from(
    name: str, tiers: str, tmp_path: Path
) -> None:
    """The state saved at 48 and the attention blocks before it leave the device for host
    memory (and, below a small host tier, a disk file); B loads them back, resumes from the
    state and computes its 10 suffix tokens only, with transformers' tokens."""
    engine = tiered_engine(name, tmp_path if tiers == "host+disk" else None)
    slowest = engine.allocator.tier_names[-1]
    hit = evict_prefix_of_a(engine, PROMPT_B)
    # every state group loads the state block at 48 (column 2), not the blocks before it
    for group in engine.plan.groups:
        if group.kind == "mamba":
            assert [index for index, _, _ in hit.loads[group.id]] == [2]
    with forward_tokens(engine.model) as forwards:
        result = engine.generate(PROMPT_B, NEW_TOKENS)
    assert result.cached_tokens_by_tier[slowest] == SHARED_PREFIX
    assert forwards[0] == 10
    assert result.token_ids == case(name)[2]["b"]
    assert engine.transfers.failed == 0
    engine.allocator.check_invariants()


@pytest.mark.parametrize("corrupt", [False, True])
def test_corrupting_the_offloaded_state_changes_the_output(corrupt: bool) -> None:
    """Bamba: noise in the host tier's copies of the state blocks C (the 48 + 1) loads
    changes C's tokens; untouched, C's tokens are transformers'."""
    engine = tiered_engine("bamba")
    hit = evict_prefix_of_a(engine, PROMPT_C)
    generator = torch.Generator().manual_seed(11)
    host = engine.buffers.tiers["host"]
    corrupted = 0
    for group in engine.plan.groups:
        if group.kind != "mamba" or not corrupt:
            continue
        for _, tier, slot in hit.loads[group.id]:
            assert tier == 1
            for layer in group.layers:
                view = host.views[layer]
                view[slot] = torch.randn(view[slot].shape, generator=generator).to(view.dtype)
                corrupted += 1
    result = engine.generate(PROMPT_C, NEW_TOKENS)
    assert result.cached_tokens_by_tier == {"device": 0, "host": SHARED_PREFIX}
    assert (result.token_ids != case("bamba")[2]["c"]) == corrupt
    assert corrupted == (3 if corrupt else 0)
