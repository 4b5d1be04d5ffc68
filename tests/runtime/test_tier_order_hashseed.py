"""The slots a tier hands out do not depend on PYTHONHASHSEED (found by review: a discard
dropped write-through copies in set order, so the free stack's order changed from one
process to the next, and replays could not be compared across processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys
sys.path.insert(0, {here!r})
from runtime_testkit import full, make_allocator
from kvspec_core.runtime import Request
from kvspec_core.runtime.tiers import OffloadTier

tier = OffloadTier("host", 8, write_policy="write_through")
allocator = make_allocator([full(2)], 12, offload_tiers=(tier,))
request = Request("A", list(range(1, 12)))
allocator.allocate_slots(request, 10, prefix=allocator.find_cached_prefix(request))
allocator.take_transfers()
allocator.allocate_slots(request, 1)
copies = allocator.take_transfers()
allocator.complete_transfers([copy.transfer_id for copy in copies])
allocator.discard_uncomputed("A", 0)
print(list(allocator._tiers.tier_pools[0][0]._fresh))
"""


@pytest.mark.both_kernels  # one run: the subprocesses choose the kernels themselves
def test_a_discard_frees_tier_slots_in_the_same_order_whatever_the_hash_seed() -> None:
    code = SCRIPT.format(here=str(Path(__file__).parent))
    orders = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        orders.add(done.stdout.strip())
    assert len(orders) == 1, orders
