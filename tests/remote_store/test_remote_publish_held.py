"""Publishing sends only the blocks the tier caches (review s26 finding 4): a write-through
copy whose block ``discard_uncomputed`` declared unwritten between take and complete is
dropped by the allocator, and must not reach the store, where it would be another replica's
hit on pages that were never computed. Against a real server on loopback."""

from __future__ import annotations

import pytest
import torch
from valkey_server import ServerProcess

from kvspec_core import FullAttentionSpec, SizingContext
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import KVCacheAllocator, OffloadTier, Request, TransferRunner
from kvspec_core.runtime.remote_store import BlockNamespace, RemoteBlockStore, RemoteStoreConfig
from kvspec_core.runtime.remote_tier import RemoteTier

pytest.importorskip("redis", reason="the remote store's client (kvspec-core[remote])")


def write_through_replica(port: int) -> tuple[KVCacheAllocator, TransferRunner, RemoteTier]:
    spec = FullAttentionSpec(block_size=2, num_kv_heads=1, head_size=2, dtype=torch.float16)
    allocator = KVCacheAllocator(
        [spec],
        16,
        SizingContext(max_model_len=32, max_in_flight_tokens=16),
        manager=PluginManager(),
        hash_salt=b"salt",
        offload_tiers=(OffloadTier("host", 8, write_policy="write_through"),),
    )
    runner = TransferRunner(
        {0: [[torch.zeros(16, 8, dtype=torch.uint8)]], 1: [[torch.zeros(8, 8, dtype=torch.uint8)]]}
    )
    store = RemoteBlockStore(BlockNamespace.of(model="m", group=0), RemoteStoreConfig(port=port))
    return allocator, runner, RemoteTier(allocator, runner, store)


@pytest.mark.parametrize("forward_failed", [False, True])
def test_a_copy_dropped_as_never_computed_is_not_published(
    valkey: ServerProcess, forward_failed: bool
) -> None:
    allocator, runner, remote = write_through_replica(valkey.port)
    request = Request("r", list(range(9)))
    assert allocator.allocate_slots(request, 9)
    remote.run_pending()  # step 1: nothing to copy yet
    request.append_token(5)
    assert allocator.allocate_slots(request, 1)  # step 2 (step 1's forward not known good)
    taken = allocator.take_transfers()  # the write-through copies of step 1's 4 blocks
    assert [(t.kind, t.num_blocks) for t in taken] == [("store", 4)]
    done, failed = runner.run(taken)
    assert not failed
    if forward_failed:  # an async engine learns now that step 1's forward failed
        allocator.discard_uncomputed("r", 0)
    allocator.complete_transfers(done, ok=True)
    published = remote.publish_completed(taken, done)
    hashes = allocator.block_hashes(Request("probe", list(range(9))), 0)
    on_server = remote.store.contains_many(list(hashes))
    if forward_failed:
        assert allocator.tier_holds(taken[0]) == [False] * 4
        assert published == 0 and on_server == [False] * 4
    else:  # the control: the same copies, computed, are cached and published
        assert allocator.tier_holds(taken[0]) == [True] * 4
        assert published == 4 and on_server == [True] * 4
    allocator.check_invariants()
