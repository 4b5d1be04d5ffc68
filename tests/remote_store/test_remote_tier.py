"""The remote store as the tier below the local ones (issue 20 item 3): a prefix replica 1
computed, evicted and published is a remote hit for replica 2, loaded through its host tier to
the device bit for bit; other namespaces never hit; a corrupt value ends the run; a killed
server costs misses within the timeouts and nothing raises into the step."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import redis
import torch
from replica_engine import (
    BLOCK,
    DEVICE_BLOCKS,
    LLAMA,
    Replica,
    compute_and_publish,
    kernel_block_views,
    pool_views,
)
from valkey_server import ServerProcess

from kvspec_core import FullAttentionSpec, SizingContext
from kvspec_core.errors import AllocatorError
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import KVCacheAllocator, OffloadTier, Request, TransferRunner
from kvspec_core.runtime.remote_tier import RemoteTier
from kvspec_core.runtime.tier_copy import BlockFile
from kvspec_core.runtime.tiers import REMOTE_TIER

PROMPT = list(range(100, 100 + 5 * BLOCK + 1))  # five full blocks are looked up
FILLER = list(range(900, 900 + 7 * BLOCK - 3))  # seven device blocks: evicts the five
#: Slack on top of the store's deadlines for a loaded CI machine: the bound proves "never
#: hangs", not speed.
SLACK_S = 5.0


def published_by_replica_1(port: int) -> tuple[list[bytes], int]:
    """Run replica 1 in this process: the prompt's pages and how many blocks it published."""
    replica = Replica(port)
    replica.admit("a", PROMPT, seed=1)
    pages = replica.pages("a", 5)
    replica.allocator.free("a")
    replica.admit("filler", FILLER, seed=2)
    return pages, replica.remote.counters.published


def test_a_prefix_another_process_computed_loads_bit_identical(valkey: ServerProcess) -> None:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    replica_1 = context.Process(
        target=compute_and_publish, args=(valkey.port, PROMPT, FILLER, results)
    )
    replica_1.start()
    try:
        pages, published = results.get(timeout=60)
    finally:
        replica_1.join(timeout=60)
    assert replica_1.exitcode == 0 and published == 5

    replica_2 = Replica(valkey.port)
    request = Request("b", PROMPT)
    assert replica_2.allocator.find_cached_prefix(request).num_tokens == 0  # empty cache
    assert replica_2.remote.fetch(request) == 5
    prefix = replica_2.allocator.find_cached_prefix(request)
    assert prefix.num_tokens == 5 * BLOCK
    assert prefix.tokens_by_tier == (0, 5 * BLOCK)  # a host tier hit, loaded to the device
    assert replica_2.allocator.allocate_slots(
        request, len(PROMPT) - prefix.num_tokens, prefix=prefix
    )
    assert replica_2.remote.run_pending() == ()
    assert replica_2.pages("b", 5) == pages
    assert replica_2.allocator._tiers.blocks_moved[(REMOTE_TIER, 1)] == 5
    replica_2.allocator.check_invariants()
    counters = replica_2.store.counters
    assert (counters.hits, counters.misses, counters.errors) == (5, 0, 0)


def test_another_namespace_or_salt_never_hits(valkey: ServerProcess) -> None:
    published_by_replica_1(valkey.port)
    other_model = Replica(valkey.port, parts={**LLAMA, "checksum:layout": "other"})
    other_salt = Replica(valkey.port, salt=b"another fleet")
    for replica in (other_model, other_salt):
        assert replica.remote.fetch(Request("b", PROMPT)) == 0
        assert replica.admit("b", PROMPT).num_tokens == 0


def test_a_corrupt_value_ends_the_run_there(valkey: ServerProcess) -> None:
    pages, _ = published_by_replica_1(valkey.port)
    replica_2 = Replica(valkey.port)
    hashes = replica_2.allocator.block_hashes(Request("b", PROMPT), 0)
    key = replica_2.store.key_of(hashes[2])
    client = redis.Redis(port=valkey.port, socket_timeout=2)
    value = bytearray(client.get(key))
    value[-1] ^= 0x01
    client.set(key, bytes(value))

    assert replica_2.remote.fetch(Request("b", PROMPT)) == 2
    assert replica_2.store.counters.corrupt == 1
    assert replica_2.remote.counters.fetch_misses == 3  # blocks 2, 3, 4: none after it
    prefix = replica_2.admit("b", PROMPT)  # its fetch ends at block 2, a remembered miss
    assert prefix.num_tokens == 2 * BLOCK
    assert replica_2.store.counters.corrupt == 1  # not read again
    assert replica_2.pages("b", 2) == pages[:2]


@pytest.mark.parametrize("failure", ["kill", "pause"])
def test_a_dead_or_hung_server_costs_bounded_misses_and_the_engine_goes_on(
    valkey: ServerProcess, failure: str
) -> None:
    published_by_replica_1(valkey.port)
    replica_2 = Replica(valkey.port)
    getattr(valkey, failure)()  # SIGKILL, or SIGSTOP: connections accepted, never answered
    started = time.monotonic()
    prefix = replica_2.admit("b", PROMPT, seed=3)  # fetch misses; nothing raises
    assert time.monotonic() - started < 3 * (0.05 + 0.2) + SLACK_S
    assert prefix.num_tokens == 0
    replica_2.allocator.free("b")
    replica_2.admit("filler", FILLER, seed=4)  # evicts "b": publishing fails, counted
    assert replica_2.remote.counters.published == 0
    assert replica_2.remote.counters.publish_failures == 5
    counters = replica_2.store.counters
    assert counters.errors + counters.timeouts + counters.skipped >= 2
    # The evicted blocks are still local tier hits.
    assert replica_2.allocator.find_cached_prefix(Request("c", PROMPT)).num_tokens == 5 * BLOCK


def allocator_with_host_tier(**options: object) -> KVCacheAllocator:
    return KVCacheAllocator(
        [FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)],
        8,
        SizingContext(max_model_len=64, max_in_flight_tokens=8),
        manager=PluginManager(),
        hash_salt=b"s",
        **options,  # type: ignore[arg-type]
    )


def test_reserved_slots_are_no_hit_until_confirmed_and_a_failure_caches_nothing() -> None:
    allocator = allocator_with_host_tier(offload_tiers=(OffloadTier("host", 16),))
    request = Request("r", PROMPT)
    hashes = allocator.block_hashes(request, 0)
    assert len(hashes) == 5
    reservation = allocator.reserve_remote_blocks(0, hashes[:3])
    assert reservation is not None and reservation.demotions == ()
    transfer = reservation.transfer
    assert transfer.source_tier == REMOTE_TIER
    assert transfer.block_hashes == hashes[:3] and transfer.destination_tier == 1
    allocator.check_invariants()
    assert allocator.find_cached_prefix(request).num_tokens == 0  # pending: no hit
    assert allocator.reserve_remote_blocks(0, hashes[:3]) is None  # in flight already
    allocator.complete_transfers([transfer.transfer_id], ok=False)
    allocator.check_invariants()
    assert allocator.find_cached_prefix(request).num_tokens == 0
    reservation = allocator.reserve_remote_blocks(0, hashes[:3])
    assert reservation is not None
    allocator.complete_transfers([reservation.transfer.transfer_id], ok=True)
    assert allocator.find_cached_prefix(request).num_tokens == 3 * BLOCK
    # Held hashes end a later run: a reservation never caches a hash twice.
    assert allocator.reserve_remote_blocks(0, hashes[:4]) is None
    allocator.check_invariants()
    with pytest.raises(AllocatorError, match=r"block_hashes\[0\] must be 32 bytes"):
        allocator.reserve_remote_blocks(0, [b"short"])
    with pytest.raises(AllocatorError, match="group=1"):
        allocator.reserve_remote_blocks(1, hashes)
    # A repeated hash would reserve two slots for one entry (its completion then failed
    # half-way, leaking both): refused up front, nothing reserved.
    pending = allocator._tiers.num_pending()
    with pytest.raises(AllocatorError, match=r"block_hashes\[2\] repeats block_hashes\[1\]"):
        allocator.reserve_remote_blocks(0, [hashes[4], hashes[3], hashes[3]])
    assert allocator._tiers.num_pending() == pending
    allocator.check_invariants()


def test_what_the_remote_tier_refuses(valkey: ServerProcess) -> None:
    replica = Replica(valkey.port)
    runner = TransferRunner({0: [pool_views(8)]})
    with pytest.raises(AllocatorError, match="no offload tiers"):
        RemoteTier(allocator_with_host_tier(), runner, replica.store)
    two_groups = KVCacheAllocator(
        [FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)] * 2,
        8,
        SizingContext(max_model_len=64, max_in_flight_tokens=8),
        manager=PluginManager(),
        offload_tiers=(OffloadTier("host", 16),),
    )
    with pytest.raises(AllocatorError, match=r"one store per group"):
        RemoteTier(two_groups, runner, replica.store)
    with pytest.raises(AllocatorError, match="share a namespace"):
        RemoteTier(two_groups, runner, {0: replica.store, 1: replica.store})
    with pytest.raises(AllocatorError, match=r"give one store for each caching group, \[0, 1\]"):
        RemoteTier(two_groups, runner, {0: replica.store})
    with pytest.raises(AllocatorError, match="max_fetch_blocks"):
        RemoteTier(replica.allocator, runner, replica.store, max_fetch_blocks=0)


def test_a_failed_write_or_a_page_of_another_size_caches_nothing(
    valkey: ServerProcess, tmp_path
) -> None:
    published_by_replica_1(valkey.port)
    replica_2 = Replica(valkey.port)
    block_bytes = replica_2.runner.block_bytes(1, 0)
    # A host file that cannot be opened for writing (a directory took its place).
    host = BlockFile(str(tmp_path / "host"), block_bytes, 16)
    os.remove(host.path)
    os.mkdir(host.path)
    replica_2.runner.storage[1] = [host]
    request = Request("b", PROMPT)
    assert replica_2.remote.fetch(request) == 0
    assert replica_2.remote.counters.write_failures == 1
    replica_2.allocator.check_invariants()
    assert replica_2.allocator.find_cached_prefix(request).num_tokens == 0
    # Pages of another size than the tier's blocks: refused whole, nothing cached.
    replica_2.runner.storage[1] = [BlockFile(str(tmp_path / "wide"), block_bytes + 2, 16)]
    assert replica_2.remote.fetch(request) == 0
    assert replica_2.remote.counters.fetch_misses == 5
    replica_2.allocator.check_invariants()
    assert replica_2.allocator.find_cached_prefix(request).num_tokens == 0


OTHER = list(range(500, 500 + 5 * BLOCK + 1))


def test_fetched_blocks_land_in_the_first_tier_and_its_victims_are_demoted_intact(
    valkey: ServerProcess,
) -> None:
    """With host and disk tiers, fetched blocks go to the host (the next lookup loads from
    there), and the host entries their slots evict move to the disk first: the demotions
    read those slots before the fetched pages overwrite them, so the disk holds the evicted
    blocks' own pages."""
    remote_pages, _ = published_by_replica_1(valkey.port)
    replica_2 = Replica(valkey.port, host_blocks=6, disk_blocks=16)  # 5 host slots
    replica_2.admit("other", OTHER, seed=5)
    other_pages = replica_2.pages("other", 5)
    replica_2.allocator.free("other")
    replica_2.admit("filler", FILLER, seed=6)  # the device evicts "other" to the host
    other = Request("other again", OTHER)
    assert replica_2.allocator.find_cached_prefix(other).tokens_by_tier == (0, 5 * BLOCK, 0)

    assert replica_2.remote.fetch(Request("b", PROMPT)) == 5
    assert replica_2.remote.counters.demoted == 5
    replica_2.allocator.check_invariants()
    assert replica_2.allocator.take_transfers() == []  # the demotions ran, handed out once
    prefix = replica_2.allocator.find_cached_prefix(Request("b", PROMPT))
    assert prefix.tokens_by_tier == (0, 5 * BLOCK, 0)  # host, not disk
    assert replica_2.allocator.find_cached_prefix(other).tokens_by_tier == (0, 0, 5 * BLOCK)

    replica_2.allocator.free("filler")
    replica_2.admit("b", PROMPT)
    assert replica_2.pages("b", 5) == remote_pages
    replica_2.allocator.free("b")
    assert replica_2.admit("other again", OTHER).tokens_by_tier == (0, 0, 5 * BLOCK)
    assert replica_2.pages("other again", 5) == other_pages
    assert replica_2.allocator._tiers.blocks_moved[(1, 2)] >= 5
    assert replica_2.allocator._tiers.blocks_moved[(REMOTE_TIER, 1)] == 5


def test_a_reservation_waits_for_the_copies_out_of_its_tier() -> None:
    """A copy out of the first tier that the engine took but has not run reads a slot that
    is free again: no reservation may hand it out meanwhile."""
    allocator = allocator_with_host_tier(
        offload_tiers=(OffloadTier("host", 6), OffloadTier("disk", 16))
    )
    for rid, prompt in (("other", OTHER), ("filler", FILLER)):
        request = Request(rid, prompt)
        assert allocator.allocate_slots(request, len(prompt))
        for transfer in allocator.take_transfers():
            allocator.complete_transfers([transfer.transfer_id])
        if rid == "other":
            allocator.free(rid)
    allocator.free("filler")  # its 6 full blocks enter the prefix cache on the device
    third = Request("third", list(range(700, 700 + 7 * BLOCK - 3)))
    assert allocator.allocate_slots(third, len(third.token_ids))
    taken = allocator.take_transfers()  # device -> host stores evicting host -> disk
    assert any(t.source_tier == 1 and t.destination_tier == 2 for t in taken)
    hashes = allocator.block_hashes(Request("b", PROMPT), 0)
    assert allocator.reserve_remote_blocks(0, hashes) is None
    allocator.complete_transfers([t.transfer_id for t in taken], ok=True)
    reservation = allocator.reserve_remote_blocks(0, hashes)
    assert reservation is not None and reservation.transfer.destination_tier == 1
    assert all(d.source_tier == 1 and d.destination_tier == 2 for d in reservation.demotions)
    assert reservation.demotions
    # Handed out with the reservation (taken), never by take_transfers.
    assert allocator.take_transfers() == []
    allocator.check_invariants()
    # The write given up before the demotions ran: its slots are free again, but the
    # demotions still have to read them, so a second reservation waits.
    allocator.complete_transfers([reservation.transfer.transfer_id], ok=False)
    assert allocator.reserve_remote_blocks(0, hashes) is None
    allocator.complete_transfers([d.transfer_id for d in reservation.demotions], ok=True)
    allocator.check_invariants()
    again = allocator.reserve_remote_blocks(0, hashes)
    assert again is not None
    allocator.complete_transfers([d.transfer_id for d in again.demotions], ok=True)
    allocator.complete_transfers([again.transfer.transfer_id], ok=True)
    allocator.check_invariants()
    assert allocator.find_cached_prefix(Request("b", PROMPT)).tokens_by_tier[1] > 0


def test_the_first_fetch_into_kernel_block_views_sizes_blocks_as_the_allocator_does(
    valkey: ServerProcess,
) -> None:
    """A replica whose storage holds two kernel rows per block fetches before its runner has
    run any transfer: the block size comes from its storage checked against the allocator,
    not one row per block (every page refused and remembered as a miss, before)."""
    replica_1 = Replica(valkey.port, views=kernel_block_views)
    replica_1.admit("a", PROMPT, seed=1)
    remote_pages = replica_1.pages("a", 5)
    replica_1.allocator.free("a")
    replica_1.admit("filler", FILLER, seed=2)
    assert replica_1.remote.counters.published == 5
    replica_2 = Replica(valkey.port, views=kernel_block_views)
    assert replica_2.remote.fetch(Request("b", PROMPT)) == 5
    assert replica_2.remote.counters.fetch_misses == 0
    assert replica_2.admit("b", PROMPT).tokens_by_tier == (0, 5 * BLOCK)
    assert replica_2.pages("b", 5) == remote_pages


def test_replicas_whose_views_order_block_bytes_otherwise_never_hit(
    valkey: ServerProcess,
) -> None:
    """Found in review: the namespace is built from the plan, which does not see
    materialize(kernel_block_sizes=...); kernel-block views order a block's bytes otherwise
    (heads and tokens swapped under LBHNC), so a replica with them read a plain replica's
    values as its own: a silent wrong load. Keys now name the storage's byte order."""
    published_by_replica_1(valkey.port)  # plain views
    kernel = Replica(valkey.port, views=kernel_block_views)
    assert kernel.store.namespace == Replica(valkey.port).store.namespace  # the same recipe
    assert kernel.remote.fetch(Request("b", PROMPT)) == 0
    assert kernel.admit("b", PROMPT).num_tokens == 0
    # Storage replaced after the tier was built is refused, not read under the old keys.
    plain = Replica(valkey.port)
    plain.runner.storage[0] = [kernel_block_views(DEVICE_BLOCKS)]
    with pytest.raises(AllocatorError, match="orders a block's bytes"):
        plain.remote.fetch(Request("c", PROMPT))
