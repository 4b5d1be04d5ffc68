"""Found in review: configurations the remote store and tier accepted and then failed on at
the first call (every call a miss, or an exception inside the engine's step). Each is now
refused up front, naming the field and the fix."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from replica_engine import BLOCK, DEVICE_BLOCKS, LLAMA, Replica
from valkey_server import ServerProcess, free_port

from kvspec_core import FullAttentionSpec, SizingContext
from kvspec_core.errors import AllocatorError
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import KVCacheAllocator, OffloadTier, TransferRunner
from kvspec_core.runtime.remote_store import BlockNamespace, RemoteBlockStore, RemoteStoreConfig
from kvspec_core.runtime.remote_tier import RemoteTier


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("ttl_s", "5", r"ttl_s='5' must be a number >= 0.001"),
        ("ttl_s", True, r"ttl_s=True must be a number >= 0.001"),
        ("op_timeout_s", True, r"op_timeout_s=True must be a positive number"),
        ("connect_timeout_s", "0.1", r"connect_timeout_s='0.1' must be a positive number"),
        ("port", 70000, r"port=70000 must be at most 65535"),
        ("port", 0, r"port=0 must be an int >= 1"),
        ("host", 123, r"host=123 must be a non-empty str"),
        ("host", "", r"host='' must be a non-empty str"),
        ("host", "127.0.0.1:6379", r"host='127.0.0.1:6379' .* give the port as port="),
        ("password", 5, r"password must be a str or None, not int"),
    ],
)
def test_a_config_field_of_the_wrong_kind_is_refused_naming_it(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=rf"RemoteStoreConfig\.{message}"):
        RemoteStoreConfig(**{field: value})  # type: ignore[arg-type]


def test_the_config_values_that_are_right_are_taken() -> None:
    config = RemoteStoreConfig(host="::1", port=65535, password="secret", ttl_s=5)
    assert (config.host, config.port, config.ttl_s) == ("::1", 65535, 5)
    assert RemoteStoreConfig(op_timeout_s=np.float64(0.5)).op_timeout_s == 0.5


def test_pages_that_are_not_one_run_of_memory_are_refused_naming_the_block() -> None:
    store = RemoteBlockStore(BlockNamespace.of(**LLAMA), RemoteStoreConfig(port=free_port()))
    strided = memoryview(bytes(range(16)))[::2]
    with pytest.raises(TypeError, match=r"put_many: block \[1\]'s pages .* not C-contiguous"):
        store.put_many([(b"a" * 32, b"ok"), (b"b" * 32, strided)])
    assert store.counters == type(store.counters)()  # nothing was sent


def test_a_store_of_another_hash_size_is_refused(valkey: ServerProcess) -> None:
    replica = Replica(valkey.port)
    store = RemoteBlockStore(
        BlockNamespace.of(**LLAMA), RemoteStoreConfig(port=valkey.port, hash_size=16)
    )
    with pytest.raises(AllocatorError, match=r"store\[0\] has RemoteStoreConfig.hash_size=16"):
        RemoteTier(replica.allocator, replica.runner, store)


def test_a_runner_without_the_storage_the_tier_uses_is_refused(valkey: ServerProcess) -> None:
    replica = Replica(valkey.port)
    no_host = TransferRunner({0: [replica.device]})
    with pytest.raises(AllocatorError, match=r"no storage for tier 1 \('host'\), pool 0"):
        RemoteTier(replica.allocator, no_host, replica.store)
    no_device = TransferRunner({1: [replica.host]})
    with pytest.raises(AllocatorError, match=r"no storage for tier 0 \('device'\), pool 0"):
        RemoteTier(replica.allocator, no_device, replica.store)
    no_slots = KVCacheAllocator(
        [FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)],
        DEVICE_BLOCKS,
        SizingContext(max_model_len=64, max_in_flight_tokens=8),
        manager=PluginManager(),
        offload_tiers=(OffloadTier("host", 0),),
    )
    with pytest.raises(AllocatorError, match="no offload tier has slots for pool 0"):
        RemoteTier(no_slots, TransferRunner({0: [replica.device]}), replica.store)
