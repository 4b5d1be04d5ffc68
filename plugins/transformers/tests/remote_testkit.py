"""Shared set-up of the remote-tier tests of kvspec-transformers: a real Valkey server on
loopback (the ``valkey`` fixture; skipped without the binary, see scripts/remote-store-env)
and engines (replicas) sharing it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers_testkit import NEW_TOKENS, PROMPT_A, SHARED_PREFIX, token_ids
from valkey_server_path import NO_SERVER, ServerProcess, running_server, server_binary

from kvspec_core.runtime.remote_store import RemoteStoreConfig
from kvspec_transformers import RemoteOptions, TransformersEngine

#: The fleet's prefix-hash salt.
SALT = b"fleet of two"


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server on 127.0.0.1 on a free port, no persistence; stopped after the test."""
    binary = server_binary()
    if binary is None or not binary.exists():
        pytest.skip(NO_SERVER)
    with running_server(tmp_path) as server:
        yield server


def remote_engine(
    model: Any,
    config: dict[str, Any],
    port: int,
    *,
    weights_id: str,
    device_bytes: int,
    host_bytes: int,
    max_model_len: int = 96,
    **store: Any,
) -> TransformersEngine:
    """An engine with a host tier whose blocks are shared through the server on ``port``."""
    return TransformersEngine(
        model,
        kvspec_config=config,
        max_model_len=max_model_len,
        budget_bytes=device_bytes,
        host_offload_bytes=host_bytes,
        remote=RemoteOptions(
            store=RemoteStoreConfig(port=port, **store), weights_id=weights_id, hash_salt=SALT
        ),
    )


def publish_a(engine: TransformersEngine) -> TransformersEngine:
    """Replica 1: run A, then three unrelated prompts that evict A's blocks from the device
    to the host tier, which publishes them."""
    assert engine.generate(PROMPT_A, NEW_TOKENS, request_id="A").cached_tokens == 0
    for seed in range(3):
        engine.generate(token_ids(57, seed=100 + seed), NEW_TOKENS)
    assert engine.remote is not None
    assert engine.remote.counters.published >= SHARED_PREFIX // 16
    assert engine.remote.counters.publish_failures == 0
    return engine
