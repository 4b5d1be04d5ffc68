"""Fetched blocks reserved in the first tier, against random engine steps (no server: the
"store" has every block, its pages a function of the hash): after every step, every block
cached on the device or in a tier holds exactly the pages of the hash it is cached under.

A step may fetch before its lookup (the reservation's demotions run first, then the pages
are written, or the write fails), take its transfers and fetch for another prompt before
running them (a reservation must not hand out a slot a copy still has to read), fail some
transfers, and run its forward. Small tiers, so every reservation evicts and demotes.
"""

from __future__ import annotations

import hashlib

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvspec_core import FullAttentionSpec, SizingContext
from kvspec_core.plugins.manager import PluginManager
from kvspec_core.runtime import KVCacheAllocator, OffloadTier, Request, TransferRunner

BLOCK = 2
PAGE = 8
PREFIXES = ([1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9], [1, 2, 3, 4, 40, 41], [50, 51])


def page_of(digest: bytes) -> torch.Tensor:
    """The pages a block cached under ``digest`` must hold."""
    return torch.frombuffer(bytearray(hashlib.blake2b(digest, digest_size=PAGE).digest()),
                            dtype=torch.uint8)  # fmt: skip


class Engine:
    def __init__(self, host: int, disk: int) -> None:
        self.allocator = KVCacheAllocator(
            [FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=2, dtype=torch.float16)],
            7,
            SizingContext(max_model_len=32, max_in_flight_tokens=16),
            manager=PluginManager(),
            hash_salt=b"content",
            offload_tiers=(OffloadTier("host", host), OffloadTier("disk", disk)),
        )
        self.storage = {
            0: torch.zeros(7, PAGE, dtype=torch.uint8),
            1: torch.zeros(host, PAGE, dtype=torch.uint8),
            2: torch.zeros(disk, PAGE, dtype=torch.uint8),
        }
        self.runner = TransferRunner({tier: [[tensor]] for tier, tensor in self.storage.items()})
        self.next_id = 0

    def fetch(self, tokens: list[int], fail_write: bool) -> None:
        """What ``RemoteTier.fetch`` does, with a store holding every block."""
        allocator = self.allocator
        request = Request("probe", tokens)
        local = allocator.find_cached_prefix(request).num_tokens
        chain = allocator.block_hashes(request, 0)
        reservation = allocator.reserve_remote_blocks(
            0, chain[local // BLOCK :], local_hit=chain[: local // BLOCK]
        )
        if reservation is None:
            return
        # Pending: no hit beyond the local one, and the slots are not cached.
        assert allocator.find_cached_prefix(request).num_tokens == local
        allocator.check_invariants()
        self.runner.run_and_complete(allocator, list(reservation.demotions))
        transfer = reservation.transfer
        if fail_write:
            allocator.complete_transfers([transfer.transfer_id], ok=False)
            return
        rows = torch.stack([page_of(digest) for digest in transfer.block_hashes])
        self.runner.write_blocks(1, 0, transfer.destination_blocks, rows)
        allocator.complete_transfers([transfer.transfer_id], ok=True)
        assert allocator.find_cached_prefix(request).num_tokens >= local + BLOCK

    def step(self, tokens: list[int], fetch: bool, fail_write: bool, between: list[int] | None,
             fail_mask: int) -> None:  # fmt: skip
        allocator = self.allocator
        if fetch:
            self.fetch(tokens, fail_write)
        self.next_id += 1
        request = Request(self.next_id, tokens)
        prefix = allocator.find_cached_prefix(request)
        if not allocator.allocate_slots(request, len(tokens) - prefix.num_tokens, prefix=prefix):
            return
        transfers = allocator.take_transfers()
        if between is not None:
            # Another prompt's fetch while this step's copies are taken and not run yet.
            self.fetch(between, fail_write=False)
        done, failed = [], []
        for position, transfer in enumerate(transfers):
            self.runner.copy(transfer)
            (failed if fail_mask >> position & 1 else done).append(transfer.transfer_id)
        allocator.complete_transfers(done, ok=True)
        dropped = allocator.complete_transfers(failed, ok=False)
        if request.request_id not in dropped:
            self.forward(request, prefix.num_tokens)
            allocator.free(request.request_id)

    def forward(self, request: Request, start: int) -> None:
        """Write each computed block: a full block its hash's pages, a partial one junk."""
        hashes = self.allocator._hasher.hashes(request, len(request.token_ids))
        table = self.allocator.block_ids(request.request_id)[0]
        for index in range(start // BLOCK, len(table)):
            full = (index + 1) * BLOCK <= len(request.token_ids)
            self.storage[0][table[index]] = (
                page_of(hashes[index]) if full else torch.full((PAGE,), 0xEE, dtype=torch.uint8)
            )

    def check_content(self) -> None:
        self.allocator.check_invariants()
        tiers = self.allocator._tiers
        caches = [(0, self.allocator.pools[0].caches[0])] + [
            (index + 1, row[0].caches[0]) for index, row in enumerate(tiers.tier_pools)
        ]
        for tier, cache in caches:
            for digest, block in cache.items():
                assert torch.equal(self.storage[tier][block], page_of(digest)), (tier, block)


STEP = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.lists(st.integers(0, 3), max_size=4),
    st.booleans(),  # fetch before the lookup
    st.sampled_from([False, False, False, True]),  # the fetched write fails
    st.none() | st.sampled_from(range(len(PREFIXES))),  # a fetch between take and run
    st.sampled_from([0, 0, 0]) | st.integers(1, 15),  # transfers that fail
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.sampled_from([(3, 3), (4, 6), (6, 4)]), steps=st.lists(STEP, max_size=25))
def test_every_cached_block_holds_its_hashes_pages(sizes, steps) -> None:
    engine = Engine(*sizes)
    for prefix, suffix, fetch, fail_write, between, fail_mask in steps:
        tokens = PREFIXES[prefix] + suffix + [0]
        other = None if between is None else PREFIXES[between] + [3, 0]
        engine.step(tokens, fetch, fail_write, other, fail_mask)
        engine.check_content()
