"""Two engines (replicas) sharing prefix blocks through a real Valkey server on loopback
(issue 20 item 3): a prefix replica 1 computed is a remote hit for replica 2, whose greedy
tokens equal transformers' own; a corrupted stored value is never used; a server killed
mid-run costs misses, never an error or a wrong token.

Replica 1 runs A (48 shared tokens + 9) and three unrelated prompts that evict A's blocks
from its device to its host tier (write-back), which publishes them. Replica 2, another
engine on another model object with the same weights, starts empty: its lookup for B (the
48 + 10) fetches them into its host tier and loads them.
"""

from __future__ import annotations

import time

import pytest
from remote_testkit import SALT, publish_a, remote_engine
from transformers_testkit import (
    NEW_TOKENS,
    PROMPT_B,
    SHARED_PREFIX,
    forward_lengths,
    fresh_model,
    model_case,
    token_ids,
)
from valkey_server_path import ServerProcess

from kvspec_core.runtime import Request
from kvspec_core.runtime.remote_store import RemoteStoreConfig
from kvspec_transformers import EngineError, RemoteOptions, TransformersEngine

redis = pytest.importorskip("redis", reason="the remote store's client (kvspec-core[remote])")

BLOCK_BYTES = {"llama": 8192, "gemma2": 16384}
DEVICE_BLOCKS = {"llama": 10, "gemma2": 15}
HOST_BLOCKS = 40


def replica(
    name: str, port: int, model=None, weights_id: str | None = None, **options: object
) -> TransformersEngine:
    case = model_case(name)
    return remote_engine(
        case.model if model is None else model,
        case.config,
        port,
        weights_id=weights_id or f"{name}-random-seed-0",
        device_bytes=DEVICE_BLOCKS[name] * BLOCK_BYTES[name],
        host_bytes=HOST_BLOCKS * BLOCK_BYTES[name],
        **options,
    )


def replica_1_publishes_a(name: str, port: int) -> TransformersEngine:
    return publish_a(replica(name, port))


def replica_2(name: str, port: int, **options: object) -> TransformersEngine:
    """A second engine, on another model object with the same weights."""
    _, model = fresh_model(name)
    return replica(name, port, model=model, **options)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_a_prefix_replica_1_computed_is_a_remote_hit_for_replica_2(
    name: str, valkey: ServerProcess
) -> None:
    replica_1_publishes_a(name, valkey.port)
    engine = replica_2(name, valkey.port)
    with forward_lengths(engine.model) as forwards:
        result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == SHARED_PREFIX
    assert result.cached_tokens_by_tier == {"device": 0, "host": SHARED_PREFIX}
    assert forwards == [10] + [1] * (NEW_TOKENS - 1)  # the 48 tokens were not computed
    assert result.token_ids == model_case(name).reference["b"]
    assert engine.remote is not None
    # Llama: its 3 blocks. Gemma 2: 3 full-attention blocks and the sliding window's
    # (24 tokens over 16-token blocks: the 2 before the hit), not the one before them.
    assert engine.remote.counters.fetched == {"llama": 3, "gemma2": 5}[name]
    engine.allocator.check_invariants()


def corrupt(engine: TransformersEngine, port: int, block: int, forge: bool) -> None:
    """Damage block ``block`` of B's prefix in group 0's store: flip a payload byte (the
    value's digest no longer matches), or ``forge`` a valid value of wrong pages."""
    assert engine.remote is not None
    store = engine.remote.stores[0]
    block_hash = engine.allocator.block_hashes(Request("probe", PROMPT_B), 0)[block]
    key = store.key_of(block_hash)
    client = redis.Redis(port=port, socket_timeout=2)
    value = bytearray(client.get(key))
    if forge:
        # A replica publishing wrong pages under the right hash: a valid value.
        payload = bytes(reversed(value[-BLOCK_BYTES["llama"] :]))
        assert store.put_many([(block_hash, payload)]) == 1
    else:
        value[-100] ^= 0x10
        client.set(key, bytes(value))


def test_a_corrupted_stored_value_is_never_used(valkey: ServerProcess) -> None:
    replica_1_publishes_a("llama", valkey.port)
    engine = replica_2("llama", valkey.port)
    corrupt(engine, valkey.port, block=1, forge=False)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == 16  # block 0 only: the run ends at the corrupt value
    assert result.token_ids == model_case("llama").reference["b"]
    assert engine.remote is not None and engine.remote.store.counters.corrupt == 1


def test_control_wrong_pages_under_a_valid_value_change_the_output(
    valkey: ServerProcess,
) -> None:
    """The negative control: pages that pass the store's check are used, and wrong ones
    change the tokens, so the test above would see a corrupt value that was used."""
    replica_1_publishes_a("llama", valkey.port)
    engine = replica_2("llama", valkey.port)
    corrupt(engine, valkey.port, block=1, forge=True)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == SHARED_PREFIX
    assert result.token_ids != model_case("llama").reference["b"]


def test_the_server_killed_mid_run_the_engine_keeps_working(valkey: ServerProcess) -> None:
    replica_1_publishes_a("llama", valkey.port)
    engine = replica_2("llama", valkey.port, failures_to_open=2)
    # Killed during a request (at its third forward), whose later steps publish nothing.
    calls: list[int] = []

    def kill_at_the_third_forward(*_: object) -> None:
        calls.append(1)
        if len(calls) == 3:
            valkey.kill()

    hook = engine.model.get_input_embeddings().register_forward_hook(kill_at_the_third_forward)
    try:
        engine.generate(token_ids(57, seed=7), NEW_TOKENS)
    finally:
        hook.remove()
    assert valkey.process is None
    for seed in range(3):  # evictions whose publishing fails
        engine.generate(token_ids(57, seed=200 + seed), NEW_TOKENS)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == 0  # nothing fetched: the server is gone
    assert result.token_ids == model_case("llama").reference["b"]
    assert engine.remote is not None
    counters = engine.remote.store.counters
    assert counters.errors + counters.timeouts + counters.skipped > 0
    assert engine.remote.counters.publish_failures > 0
    # The local tiers still work: B again is a local hit.
    again = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B again")
    assert again.cached_tokens == SHARED_PREFIX
    assert again.token_ids == model_case("llama").reference["b"]
    engine.allocator.check_invariants()


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_the_server_back_the_engine_gets_remote_hits_again(
    name: str, valkey: ServerProcess
) -> None:
    """Recovery: replica 2 runs while the server is dead (its breaker opens; misses, its
    own tokens), the server comes back empty on the same port, a new replica 1 publishes A
    again, and once the breaker's open period is over replica 2's next lookup for B is a
    remote hit again, token-identical, with no restart of replica 2. Gemma 2: both groups'
    stores recover through their one server."""
    open_for_s = 2.0
    engine = replica_2(name, valkey.port, failures_to_open=2, open_for_s=open_for_s)
    assert engine.remote is not None
    stores = list(engine.remote.stores.values())
    valkey.kill()
    # Requests until the breaker opens (its fetches and publishes fail): tokens their own.
    for seed in range(3):
        result = engine.generate(token_ids(57, seed=400 + seed), NEW_TOKENS)
        assert result.cached_tokens == 0
        if all(store.breaker_open for store in stores):
            break
    assert all(store.breaker_open for store in stores)
    failed = sum(store.counters.errors + store.counters.timeouts for store in stores)
    assert failed >= 2

    valkey.start()  # empty: what replica 2 could not publish is not there
    replica_1_publishes_a(name, valkey.port)
    # The breaker's clock is the real monotonic one: past its open period, the next call
    # is tried, answered, and closes the breaker for every group.
    time.sleep(open_for_s * 1.2)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == SHARED_PREFIX
    assert result.cached_tokens_by_tier == {"device": 0, "host": SHARED_PREFIX}
    assert result.token_ids == model_case(name).reference["b"]
    assert not any(store.breaker_open for store in stores)
    assert sum(store.counters.errors + store.counters.timeouts for store in stores) == failed
    assert engine.remote.counters.fetched > 0
    engine.allocator.check_invariants()


def test_a_hybrids_groups_learn_once_that_the_server_is_down(valkey: ServerProcess) -> None:
    """Gemma 2 (full attention + sliding window: a store per group) with its server killed:
    the groups' stores share the server's breaker, so the engine pays ``failures_to_open``
    failed calls in all, not that many per group; its tokens stay transformers' own."""
    replica_1_publishes_a("gemma2", valkey.port)
    engine = replica_2("gemma2", valkey.port, failures_to_open=2, open_for_s=3600.0)
    assert engine.remote is not None
    stores = list(engine.remote.stores.values())
    assert len(stores) == 2
    valkey.kill()
    for seed in range(3):  # each fetches (both groups asked) and publishes its evictions
        engine.generate(token_ids(57, seed=300 + seed), NEW_TOKENS)
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == 0  # nothing fetched: the server is gone
    assert result.token_ids == model_case("gemma2").reference["b"]
    failed = sum(store.counters.errors + store.counters.timeouts for store in stores)
    assert failed == 2  # a server per group paid 2 each
    assert sum(store.counters.skipped for store in stores) >= 2 * 4 - failed
    assert all(store.breaker_open for store in stores)
    engine.allocator.check_invariants()


def test_what_the_remote_option_refuses(valkey: ServerProcess) -> None:
    case = model_case("llama")
    options = RemoteOptions(
        store=RemoteStoreConfig(port=valkey.port), weights_id="w", hash_salt=SALT
    )
    with pytest.raises(EngineError, match="remote needs a host tier"):
        TransformersEngine(case.model, kvspec_config=case.config, remote=options)
    with pytest.raises(EngineError, match="weights_id must name the model's weights"):
        RemoteOptions(store=RemoteStoreConfig(), weights_id=" ", hash_salt=SALT)
    with pytest.raises(EngineError, match="hash_salt must be non-empty bytes"):
        RemoteOptions(store=RemoteStoreConfig(), weights_id="w", hash_salt=b"")


def test_a_load_that_keeps_failing_ends_after_one_fetch(valkey: ServerProcess) -> None:
    """A host->device load that fails every time (a device OOM on the copy) drops the host
    copy; the retry must not fetch the same block back from the store, or generate loops
    forever. The guard below stops a looping generate so that the test fails, not hangs."""
    replica_1_publishes_a("llama", valkey.port)
    engine = replica_2("llama", valkey.port)
    assert engine.remote is not None
    runner = engine.transfers.runner
    real_copy = runner.copy

    def copy_failing_loads(transfer):  # type: ignore[no-untyped-def]
        if transfer.kind == "load":
            raise RuntimeError("out of memory on the host->device copy (injected)")
        return real_copy(transfer)

    runner.copy = copy_failing_loads
    real_fetch = engine.remote.fetch
    fetches: list[int] = []

    def counted_fetch(request: Request) -> object:
        fetches.append(1)
        if len(fetches) > 5:
            raise AssertionError("generate fetched again after each failed load: a loop")
        return real_fetch(request)

    engine.remote.fetch = counted_fetch  # type: ignore[method-assign]
    result = engine.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert fetches == [1]
    assert engine.remote.counters.fetched == 3
    assert result.cached_tokens == 0  # the fetched blocks could not be loaded: recomputed
    assert result.token_ids == model_case("llama").reference["b"]
    engine.allocator.check_invariants()


def test_replicas_differing_only_in_max_model_len_share_blocks(valkey: ServerProcess) -> None:
    """max_model_len (and the batched-token budget) change no block's bytes: they stay out
    of the namespace, so a replica configured longer still hits what replica 1 published;
    another weights_id never does."""
    replica_1 = replica_1_publishes_a("llama", valkey.port)
    longer = replica_2("llama", valkey.port, max_model_len=128)
    assert longer.remote is not None and replica_1.remote is not None
    assert longer.remote.store.namespace == replica_1.remote.store.namespace
    other = replica("llama", valkey.port, weights_id="llama-other-weights")
    assert other.remote is not None
    assert other.remote.store.namespace != replica_1.remote.store.namespace
    result = longer.generate(PROMPT_B, NEW_TOKENS, request_id="B")
    assert result.cached_tokens == SHARED_PREFIX
    assert result.token_ids == model_case("llama").reference["b"]
