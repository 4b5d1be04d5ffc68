"""A small engine replica for the remote tier's tests: a full-attention allocator with a host
tier, CPU tensors as its device and host pools, a TransferRunner and a RemoteTier on a real
server. Its "forward" writes seeded random pages into the blocks it computes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvspec_core import FullAttentionSpec, SizingContext
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import KVCacheAllocator, OffloadTier, Request, TransferRunner
from kvspec_core.runtime.remote_store import (
    BlockNamespace,
    RemoteBlockStore,
    RemoteServer,
    RemoteStoreConfig,
)
from kvspec_core.runtime.remote_tier import RemoteTier

BLOCK = 4
DEVICE_BLOCKS = 8
HOST_BLOCKS = 16
SALT = b"fleet-salt"
LLAMA: dict[str, Any] = {"checksum:layout": "3f0a", "checksum:groups[0].spec": "91bc", "pool": 0}


def pool_views(num_blocks: int) -> list[torch.Tensor]:
    """Two layer views of one pool (keys fp16, values int32-strided), block dim first."""
    keys = torch.zeros(num_blocks, BLOCK, 1, 8, dtype=torch.float16)
    values = torch.zeros(3, num_blocks, BLOCK, dtype=torch.int32).transpose(0, 1)
    return [keys, values]


def kernel_block_views(num_blocks: int) -> list[torch.Tensor]:
    """pool_views as materialize(kernel_block_sizes=...) gives them: two rows of half a
    block per block, the same bytes per block."""
    keys = torch.zeros(2 * num_blocks, BLOCK // 2, 1, 8, dtype=torch.float16)
    values = torch.zeros(3, 2 * num_blocks, BLOCK // 2, dtype=torch.int32).transpose(0, 1)
    return [keys, values]


class Replica:
    """One engine process's allocator, storage and remote tier."""

    def __init__(
        self,
        port: int,
        salt: bytes = SALT,
        parts: dict[str, Any] = LLAMA,
        *,
        host_blocks: int = HOST_BLOCKS,
        disk_blocks: int = 0,
        remote: dict[str, Any] | None = None,
        views: Callable[[int], list[torch.Tensor]] = pool_views,
        **config: Any,
    ) -> None:
        tiers = [OffloadTier("host", host_blocks)]
        if disk_blocks:
            tiers.append(OffloadTier("disk", disk_blocks))
        self.allocator = KVCacheAllocator(
            [FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float16)],
            DEVICE_BLOCKS,
            SizingContext(max_model_len=64, max_in_flight_tokens=8),
            manager=PluginManager(),
            hash_salt=salt,
            offload_tiers=tuple(tiers),
        )
        self.device, self.host = views(DEVICE_BLOCKS), views(host_blocks)
        storage = {0: [self.device], 1: [self.host]}
        if disk_blocks:
            self.disk = views(disk_blocks)
            storage[2] = [self.disk]
        self.runner = TransferRunner(storage)
        self.store = RemoteBlockStore(
            BlockNamespace.of(**parts), RemoteStoreConfig(port=port, **config)
        )
        self.remote = RemoteTier(self.allocator, self.runner, self.store, **(remote or {}))

    def admit(self, rid: str, tokens: list[int], seed: int | None = None) -> Any:
        """Fetch, look up, admit and run the step's transfers; with ``seed``, the forward
        writes random pages into the blocks after the hit. Returns the prefix."""
        request = Request(rid, tokens)
        self.remote.fetch(request)
        prefix = self.allocator.find_cached_prefix(request)
        result = self.allocator.allocate_slots(
            request, len(tokens) - prefix.num_tokens, prefix=prefix
        )
        assert result, result
        assert self.remote.run_pending() == ()
        if seed is not None:
            self.write_forward(rid, prefix.num_tokens, seed)
        self.allocator.check_invariants()
        return prefix

    def write_forward(self, rid: str, start: int, seed: int) -> None:
        """The forward: random pages into the blocks of every group from token ``start`` on
        (a null entry, a block a sliding window skips, is not written)."""
        generator = torch.Generator().manual_seed(seed)
        tables = self.allocator.block_ids(rid)
        blocks = [block for table in tables for block in table[start // BLOCK :] if block]
        for tensor in self.device:
            rows = tensor.shape[0] // self.allocator.pools[0].num_blocks  # kernel rows
            ids = torch.tensor([b * rows + r for b in blocks for r in range(rows)])
            fresh = torch.randint(-100, 100, (len(ids), *tensor.shape[1:]),
                                  generator=generator).to(tensor.dtype)  # fmt: skip
            tensor.index_copy_(0, ids, fresh)

    def pages(self, rid: str, num_blocks: int) -> list[bytes]:
        """The device pages of the request's first ``num_blocks`` blocks."""
        blocks = list(self.allocator.block_ids(rid)[0][:num_blocks])
        rows = self.runner.read_blocks(0, 0, blocks)
        return [rows[row].numpy().tobytes() for row in range(num_blocks)]


def compute_and_publish(port: int, tokens: list[int], filler: list[int], out: Any) -> None:
    """Replica 1 (a spawned process): compute ``tokens``, finish, let ``filler`` evict its
    blocks (written back to the host tier, published), and put ``(pages, published)``."""
    replica = Replica(port)
    replica.admit("a", tokens, seed=1)
    full = (len(tokens) - 1) // BLOCK
    pages = replica.pages("a", full)
    replica.allocator.free("a")
    replica.admit("filler", filler, seed=2)
    replica.store.close()
    out.put((pages, replica.remote.counters.published))


WINDOW = 6  # tokens: a hit past the first window needs the 2 blocks before it
HYBRID_DEVICE_BLOCKS = 24


def sliding_window_manager() -> PluginManager:
    """A fresh plugin manager with the sliding-window family."""
    from kvspec_sliding_window import plugin as sliding_plugin

    manager = PluginManager()
    manager.register(sliding_plugin, "sliding_window")
    return manager


class HybridReplica(Replica):
    """A replica of a full attention + sliding window model (one shared pool), with a store
    per group, all on one ``RemoteServer`` (``shared_server=False``: a server per group, as
    the tier had before: each group learns on its own that the server is down). ``clock``
    is the breakers'."""

    def __init__(
        self,
        port: int,
        parts: dict[str, Any] = LLAMA,
        *,
        sliding_only: bool = False,
        shared_server: bool = True,
        clock: Callable[[], float] | None = None,
        **config: Any,
    ) -> None:
        from kvspec_sliding_window.specs import SlidingWindowSpec

        head = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
        window = SlidingWindowSpec(block_size=BLOCK, sliding_window=WINDOW, **head)
        specs = [window] if sliding_only else [FullAttentionSpec(block_size=BLOCK, **head), window]
        self.allocator = KVCacheAllocator(
            specs,
            HYBRID_DEVICE_BLOCKS,
            SizingContext(max_model_len=64, max_in_flight_tokens=32),
            manager=sliding_window_manager(),
            hash_salt=SALT,
            offload_tiers=(OffloadTier("host", 64),),
        )
        self.device, self.host = pool_views(HYBRID_DEVICE_BLOCKS), pool_views(64)
        self.runner = TransferRunner({0: [self.device], 1: [self.host]})
        store_config = RemoteStoreConfig(port=port, **config)
        timing = {} if clock is None else {"clock": clock}
        shared = RemoteServer(store_config, **timing)
        self.stores = {
            gid: RemoteBlockStore(
                BlockNamespace.of(**parts, group=gid),
                shared if shared_server else RemoteServer(store_config, **timing),
            )
            for gid in range(len(specs))
        }
        self.store = self.stores[0]
        self.remote = RemoteTier(
            self.allocator, self.runner, self.store if sliding_only else self.stores
        )

    def group_pages(self, rid: str, group: int, indices: list[int]) -> list[bytes]:
        table = self.allocator.block_ids(rid)[group]
        rows = self.runner.read_blocks(0, 0, [table[i] for i in indices])
        return [rows[row].numpy().tobytes() for row in range(len(indices))]
