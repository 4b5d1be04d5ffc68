"""Found in review: ``RemoteTier.run_pending`` completed the step's transfers (a failed load
drops its request and frees its blocks) and then published; when publishing raised, the
requests to drop were lost with the exception. Storage the tier refuses is now refused
before anything is taken, and a publishing that fails after the transfers completed is
counted, so the requests to drop always come back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from replica_engine import BLOCK, Replica
from valkey_server import ServerProcess

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import Request
from kvspec_core.runtime.tier_copy import BlockFile

PROMPT = list(range(100, 100 + 5 * BLOCK + 1))
FILLERS = [list(range(start, start + 7 * BLOCK - 3)) for start in (900, 2000)]


def admitted_from_a_broken_disk(port: int, tmp_path: Path) -> Replica:
    """A replica (host and disk tiers in files) that admitted "b", whose hit lies on the
    disk, and whose disk file then became unreadable: this step's loads will fail."""
    replica = Replica(port, host_blocks=6, disk_blocks=16)
    block_bytes = replica.runner.block_bytes(1, 0)
    replica.runner.storage[1] = [BlockFile(str(tmp_path / "host"), block_bytes, 6)]
    disk = BlockFile(str(tmp_path / "disk"), block_bytes, 16)
    replica.runner.storage[2] = [disk]
    for turn, tokens in enumerate([PROMPT, *FILLERS]):
        replica.admit(f"r{turn}", tokens, seed=turn)
        replica.allocator.free(f"r{turn}")
    request = Request("b", PROMPT)
    prefix = replica.allocator.find_cached_prefix(request)
    assert prefix.tokens_by_tier == (0, 0, 5 * BLOCK)
    assert replica.allocator.allocate_slots(request, len(PROMPT) - prefix.num_tokens, prefix=prefix)
    os.remove(disk.path)
    os.mkdir(disk.path)
    return replica


def test_storage_the_tier_refuses_is_refused_before_a_transfer_is_taken(
    valkey: ServerProcess, tmp_path: Path
) -> None:
    replica = admitted_from_a_broken_disk(valkey.port, tmp_path)
    keys, values = replica.device
    device = replica.runner.storage[0]
    replica.runner.storage[0] = [[keys.view(torch.int16), values]]  # another byte order
    pending = replica.allocator._tiers.num_pending()
    with pytest.raises(AllocatorError, match="orders a block's bytes"):
        replica.remote.run_pending()
    # Nothing taken or completed: "b" still runs, its loads still pending.
    assert replica.allocator.is_running("b")
    assert replica.allocator._tiers.num_pending() == pending > 0
    replica.runner.storage[0] = device
    assert replica.remote.run_pending() == ("b",)
    replica.allocator.check_invariants()


def test_a_publishing_that_fails_still_returns_the_requests_to_drop(
    valkey: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica = admitted_from_a_broken_disk(valkey.port, tmp_path)

    def fail(blocks: object) -> int:
        raise RuntimeError("a bug in publishing")

    monkeypatch.setattr(replica.store, "put_many", fail)
    before = replica.remote.counters.publish_failures
    with pytest.warns(RuntimeWarning, match="a bug in publishing"):
        assert replica.remote.run_pending() == ("b",)
    assert replica.remote.counters.publish_failures > before  # the step's write-backs
    replica.allocator.check_invariants()
