"""Found in review: a value with a valid header and digest but pages of another size than the
tier's blocks (another layout published under the namespace, another replica's bug) was
refused only after host slots were reserved, so their entries were evicted for nothing, and
the good pages before it were dropped with it. The size is now checked before any slot is
taken: the run ends at the first page of another size, as at a corrupt value."""

from __future__ import annotations

import attrs
import redis
from replica_engine import BLOCK, Replica
from valkey_server import ServerProcess

from kvspec_core.runtime import Request
from kvspec_core.runtime.remote_values import HEADER_SIZE, encode_value

PROMPT = list(range(100, 100 + 5 * BLOCK + 1))  # five full blocks are looked up
OTHER = list(range(500, 500 + 5 * BLOCK + 1))
FILLER = list(range(900, 900 + 7 * BLOCK - 3))  # seven device blocks: evicts the five


def publish_prompt(port: int) -> list[bytes]:
    """Replica 1 computes the prompt and evicts it (published); returns its pages."""
    replica = Replica(port)
    replica.admit("a", PROMPT, seed=1)
    pages = replica.pages("a", 5)
    replica.allocator.free("a")
    replica.admit("filler", FILLER, seed=2)
    assert replica.remote.counters.published == 5
    return pages


def shorten(port: int, replica: Replica, block: int) -> None:
    """Replace the prompt's ``block``'s value by a valid one 2 bytes short."""
    client = redis.Redis(port=port, socket_timeout=2)
    digest = replica.allocator.block_hashes(Request("x", PROMPT), 0)[block]
    key = replica.store.key_of(digest)
    client.set(key, encode_value(key, client.get(key)[HEADER_SIZE:-2]))


def replica_holding_other(port: int) -> Replica:
    """A replica whose five usable host slots hold OTHER's five blocks (no tier below)."""
    replica = Replica(port, host_blocks=6)
    for rid, tokens, seed in (("other", OTHER, 5), ("filler", FILLER, 6)):
        replica.admit(rid, tokens, seed=seed)
        replica.allocator.free(rid)
    assert host_hit(replica, OTHER) == 5 * BLOCK
    return replica


def host_hit(replica: Replica, tokens: list[int]) -> int:
    """Tokens of ``tokens``' hit found in the host tier (none on the device)."""
    prefix = replica.allocator.find_cached_prefix(Request("lookup", tokens))
    if prefix.num_tokens == 0:
        return 0
    device, host = prefix.tokens_by_tier
    assert device == 0
    return host


def test_a_first_page_of_another_size_takes_no_slot(valkey: ServerProcess) -> None:
    publish_prompt(valkey.port)
    replica = replica_holding_other(valkey.port)
    shorten(valkey.port, replica, 0)
    before = attrs.evolve(replica.remote.counters)
    assert replica.remote.fetch(Request("b", PROMPT)) == 0
    # OTHER's host entries were not evicted for pages that could not be written.
    assert host_hit(replica, OTHER) == 5 * BLOCK
    counters = replica.remote.counters
    assert (counters.fetched, counters.demoted, counters.write_failures) == (0, 0, 0)
    assert counters.fetch_misses - before.fetch_misses == 5  # block 0 and the run after it
    assert counters.misses_remembered - before.misses_remembered == 1
    replica.allocator.check_invariants()


def test_the_pages_before_one_of_another_size_are_cached(valkey: ServerProcess) -> None:
    pages = publish_prompt(valkey.port)
    replica = Replica(valkey.port)
    shorten(valkey.port, replica, 4)
    assert replica.remote.fetch(Request("b", PROMPT)) == 4
    counters = replica.remote.counters
    assert (counters.fetched, counters.fetch_misses, counters.misses_remembered) == (4, 1, 1)
    hashes = replica.allocator.block_hashes(Request("b", PROMPT), 0)
    assert replica.remote.misses.first_missed(hashes) == 4  # not asked again at once
    prefix = replica.admit("b", PROMPT)
    assert prefix.tokens_by_tier == (0, 4 * BLOCK)
    assert replica.pages("b", 4) == pages[:4]
