"""Replicas of state-layer models (Bamba: Mamba-2 + attention; Qwen3-Next: gated delta-net +
attention) sharing prefixes through a real Valkey server (issue 20 item 3): replica 2 fetches
the attention blocks of the 48-token prefix and, per state group, only the state saved at
48 (the checkpoint a hit there resumes from), and its greedy tokens equal transformers'."""

from __future__ import annotations

import pytest

pytest.importorskip("kvspec_mamba", reason="kvspec-mamba (the state family) is not installed")
pytest.importorskip("redis", reason="the remote store's client (kvspec-core[remote])")

from remote_testkit import publish_a, remote_engine
from test_transformers_state_models import (
    BLOCK_BYTES,
    DEVICE_BLOCKS,
    MODELS,
    case,
    device_budget,
    forward_tokens,
)
from transformers_testkit import NEW_TOKENS, PROMPT_B, SHARED_PREFIX
from valkey_server_path import ServerProcess

from kvspec_transformers import TransformersEngine, build_model


def replica(name: str, port: int, model: object) -> TransformersEngine:
    config, _, _ = case(name)
    engine = remote_engine(
        model,
        config,
        port,
        weights_id=f"{name}-random-seed-0",
        device_bytes=device_budget(name),
        host_bytes=40 * BLOCK_BYTES[name],
    )
    assert [pool.num_blocks for pool in engine.plan.pools] == DEVICE_BLOCKS
    return engine


@pytest.mark.parametrize("name", MODELS)
def test_a_state_models_prefix_is_a_remote_hit_resumed_from_the_fetched_state(
    name: str, valkey: ServerProcess
) -> None:
    config, model, reference = case(name)
    publish_a(replica(name, valkey.port, model))
    engine = replica(name, valkey.port, build_model(config, seed=0))  # same weights
    state_groups = [group.id for group in engine.plan.groups if group.kind == "mamba"]
    with forward_tokens(engine.model) as forwards:
        result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens_by_tier == {"device": 0, "host": SHARED_PREFIX}
    assert forwards[0] == 10  # resumed from the fetched state: the 48 were not computed
    assert result.token_ids == reference["b"]
    assert engine.remote is not None
    # The attention group's 3 blocks and one state per state group, not the states before.
    assert engine.remote.counters.fetched == 3 + len(state_groups)
    engine.allocator.check_invariants()
