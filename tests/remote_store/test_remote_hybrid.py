"""The remote tier for a full attention + sliding window hybrid (issue 20 item 3): each group
has its own store, a fetch brings only what a hit every group can resume from needs (the
full-attention run and the window's last blocks, not the blocks before the window), and a
block missing or refused on the server never makes a hit the groups could not resume from.
A family it does not serve is refused, naming it (Mamba hybrids: test_remote_hybrid_plan.py
and kvspec-transformers' Bamba / Qwen3-Next test)."""

from __future__ import annotations

import pytest
import redis
import torch
from replica_engine import BLOCK, LLAMA, HybridReplica, sliding_window_manager
from valkey_server import ServerProcess

from kvspec_core import FullAttentionSpec, SizingContext
from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import KVCacheAllocator, OffloadTier, Request, TransferRunner
from kvspec_core.runtime.remote_store import BlockNamespace, RemoteBlockStore, RemoteStoreConfig
from kvspec_core.runtime.remote_tier import RemoteTier
from kvspec_core.runtime.remote_values import HEADER_SIZE, encode_value

PROMPT = list(range(100, 100 + 5 * BLOCK + 1))  # five full blocks per group are looked up
WINDOW_BLOCKS = 2  # a window of 6 tokens over blocks of 4: the 2 blocks before the hit


def published_by_replica_1(port: int, **options: bool) -> tuple[list[bytes], list[bytes]]:
    """Replica 1 computes the prompt, then other prompts evict it (written back to its host
    tier and published, both groups). Returns both groups' pages of the five blocks (the
    one group's twice with ``sliding_only``)."""
    replica = HybridReplica(port, **options)
    replica.admit("a", PROMPT, seed=1)
    last = len(replica.stores) - 1
    pages = (
        replica.group_pages("a", 0, list(range(5))),
        replica.group_pages("a", last, list(range(5))),
    )
    replica.allocator.free("a")
    for turn in range(4):
        rid = f"filler {turn}"
        replica.admit(
            rid, list(range(1000 * (turn + 1), 1000 * (turn + 1) + 5 * BLOCK + 1)), seed=2
        )
        replica.allocator.free(rid)
    counters = replica.remote.counters
    # (a lone window group: at least its last window; the device may keep the rest)
    assert counters.published >= (10 if last else WINDOW_BLOCKS)
    assert counters.publish_failures == 0
    assert replica.allocator.find_cached_prefix(Request("x", PROMPT)).tokens_by_tier[0] == 0
    return pages


def test_a_hybrid_prefix_is_a_remote_hit_and_only_the_window_is_fetched(
    valkey: ServerProcess,
) -> None:
    full_pages, window_pages = published_by_replica_1(valkey.port)
    replica_2 = HybridReplica(valkey.port)
    request = Request("b", PROMPT)
    assert replica_2.allocator.find_cached_prefix(request).num_tokens == 0
    # Five full-attention blocks and the window's two, not the three before it.
    assert replica_2.remote.fetch(request) == 5 + WINDOW_BLOCKS
    prefix = replica_2.allocator.find_cached_prefix(request)
    assert prefix.num_tokens == 5 * BLOCK and prefix.tokens_by_tier == (0, 5 * BLOCK)
    replica_2.admit("b", PROMPT)
    assert replica_2.group_pages("b", 0, list(range(5))) == full_pages
    assert replica_2.group_pages("b", 1, [3, 4]) == window_pages[3:]
    assert replica_2.allocator.block_ids("b")[1][:3] == (0, 0, 0)  # never needed, never fetched
    replica_2.allocator.check_invariants()


def test_a_sliding_window_model_fetches_only_the_window(valkey: ServerProcess) -> None:
    """One group, a sliding window: planned like a hybrid, not fetched as a run."""
    _, window_pages = published_by_replica_1(valkey.port, sliding_only=True)
    replica_2 = HybridReplica(valkey.port, sliding_only=True)
    request = Request("b", PROMPT)
    assert replica_2.remote.fetch(request) == WINDOW_BLOCKS
    assert replica_2.allocator.find_cached_prefix(request).num_tokens == 5 * BLOCK
    replica_2.admit("b", PROMPT)
    assert replica_2.group_pages("b", 0, [3, 4]) == window_pages[3:]


def test_a_window_block_missing_on_the_server_gives_the_hit_the_window_allows(
    valkey: ServerProcess,
) -> None:
    """The full-attention run reaches 5 blocks, but the window's last block is gone: the hit
    is where the window is whole (4 blocks), never 5 with a window the group lacks."""
    full_pages, window_pages = published_by_replica_1(valkey.port)
    replica_2 = HybridReplica(valkey.port)
    chain = replica_2.allocator.block_hashes(Request("b", PROMPT), 1)
    redis.Redis(port=valkey.port, socket_timeout=2).delete(replica_2.stores[1].key_of(chain[4]))

    assert replica_2.remote.fetch(Request("b", PROMPT)) == 4 + WINDOW_BLOCKS
    assert replica_2.allocator.find_cached_prefix(Request("b", PROMPT)).num_tokens == 4 * BLOCK
    replica_2.admit("b", PROMPT)
    assert replica_2.group_pages("b", 0, list(range(4))) == full_pages[:4]
    assert replica_2.group_pages("b", 1, [2, 3]) == window_pages[2:4]


def test_a_corrupt_window_block_writes_nothing_then_is_planned_around(
    valkey: ServerProcess,
) -> None:
    """A value refused when fetched ends that fetch with nothing written (no block the hit
    cannot use); remembered as a miss, the next fetch plans the hit without it."""
    published_by_replica_1(valkey.port)
    replica_2 = HybridReplica(valkey.port)
    chain = replica_2.allocator.block_hashes(Request("b", PROMPT), 1)
    client = redis.Redis(port=valkey.port, socket_timeout=2)
    key = replica_2.stores[1].key_of(chain[4])
    client.set(key, client.get(key)[:-1])

    assert replica_2.remote.fetch(Request("b", PROMPT)) == 0
    assert replica_2.allocator.find_cached_prefix(Request("b", PROMPT)).num_tokens == 0
    assert replica_2.stores[1].counters.corrupt == 1
    replica_2.allocator.check_invariants()
    assert replica_2.remote.fetch(Request("b", PROMPT)) == 4 + WINDOW_BLOCKS
    assert replica_2.allocator.find_cached_prefix(Request("b", PROMPT)).num_tokens == 4 * BLOCK


def test_a_window_page_of_another_size_reserves_nothing(valkey: ServerProcess) -> None:
    """Found in review: a window value with a valid header and digest but 2 bytes short was
    refused only when its group's run was written, after the full-attention group's run was
    reserved (evicting) and written: the fetch returned 5, not nothing. Every group's pages
    are now checked before any slot is reserved."""
    published_by_replica_1(valkey.port)
    replica_2 = HybridReplica(valkey.port)
    chain = replica_2.allocator.block_hashes(Request("b", PROMPT), 1)
    client = redis.Redis(port=valkey.port, socket_timeout=2)
    key = replica_2.stores[1].key_of(chain[4])
    client.set(key, encode_value(key, client.get(key)[HEADER_SIZE:-2]))

    assert replica_2.remote.fetch(Request("b", PROMPT)) == 0
    counters = replica_2.remote.counters
    assert (counters.fetched, counters.fetch_misses, counters.misses_remembered) == (0, 1, 1)
    host = replica_2.allocator._tiers.tier_pools[0][0]
    assert host.num_free_blocks == host.num_blocks - 1  # no slot taken, none written
    replica_2.allocator.check_invariants()
    # Remembered as a miss: the next fetch plans the hit without it.
    assert replica_2.remote.fetch(Request("b", PROMPT)) == 4 + WINDOW_BLOCKS
    assert replica_2.allocator.find_cached_prefix(Request("b", PROMPT)).num_tokens == 4 * BLOCK


def test_a_dead_server_costs_a_hybrid_nothing_but_misses(valkey: ServerProcess) -> None:
    published_by_replica_1(valkey.port)
    replica_2 = HybridReplica(valkey.port)
    valkey.kill()
    assert replica_2.admit("b", PROMPT, seed=3).num_tokens == 0
    replica_2.allocator.check_invariants()


def test_a_family_the_remote_tier_does_not_serve_is_refused_naming_it(
    valkey: ServerProcess,
) -> None:
    from kvspec_chunked_local import plugin as chunked_plugin
    from kvspec_chunked_local.specs import ChunkedLocalAttentionSpec

    manager = sliding_window_manager()
    manager.register(chunked_plugin, "chunked_local")
    head = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    allocator = KVCacheAllocator(
        [
            FullAttentionSpec(block_size=4, **head),
            ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **head),
        ],
        16,
        SizingContext(max_model_len=64, max_in_flight_tokens=8),
        manager=manager,
        offload_tiers=(OffloadTier("host", 8),),
    )
    stores = {
        gid: RemoteBlockStore(
            BlockNamespace.of(**LLAMA, group=gid), RemoteStoreConfig(port=valkey.port)
        )
        for gid in (0, 1)
    }
    with pytest.raises(AllocatorError, match=r"group 1 \(chunked_local_attention\) has rules"):
        RemoteTier(allocator, TransferRunner({}), stores)
