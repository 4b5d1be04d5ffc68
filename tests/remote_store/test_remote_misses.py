"""The remote tier remembers recent misses (issue 20 item 3): a hash the server answered it
did not have is not asked again until the miss expires, a block published meanwhile is found
after the expiry, failed calls are never remembered, and the memory is bounded."""

from __future__ import annotations

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st
from replica_engine import HybridReplica, Replica
from test_remote_tier import PROMPT, published_by_replica_1
from valkey_server import ServerProcess

from kvspec_core.errors import AllocatorError
from kvspec_core.runtime import Request
from kvspec_core.runtime.remote_misses import RecentMisses
from kvspec_core.runtime.remote_values import encode_value


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def server_lookups(server: ServerProcess) -> int:
    """EXISTS and MGET commands the server ran so far."""
    stats = redis.Redis(port=server.port, socket_timeout=2).info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("exists", "mget"))


def test_a_miss_is_not_asked_again_until_it_expires(valkey: ServerProcess) -> None:
    clock = Clock()
    replica_2 = Replica(valkey.port, remote={"miss_ttl_s": 5.0, "clock": clock})
    request = Request("b", PROMPT)
    assert replica_2.remote.fetch(request) == 0
    asked = server_lookups(valkey)
    assert asked > 0 and replica_2.remote.counters.misses_remembered == 1

    assert replica_2.remote.fetch(request) == 0
    assert server_lookups(valkey) == asked  # not asked again
    counters = replica_2.remote.counters
    assert (counters.remembered_miss_hits, counters.fetches_not_asked) == (1, 1)

    # Another replica publishes the prefix: within the expiry this one still misses it (the
    # documented price), after it the first fetch finds it.
    published_by_replica_1(valkey.port)
    asked = server_lookups(valkey)  # (replica 1 asked too)
    clock.now += 4.9
    assert replica_2.remote.fetch(request) == 0
    assert server_lookups(valkey) == asked
    clock.now += 0.1
    assert replica_2.remote.fetch(request) == 5
    assert replica_2.admit("b", PROMPT).num_tokens == 5 * 4


def test_a_failed_call_is_never_remembered(valkey: ServerProcess) -> None:
    """A hung server's misses say nothing about what it holds: once it answers again, a
    block published meanwhile is found at once, whatever the expiry."""
    replica_2 = Replica(valkey.port, remote={"miss_ttl_s": 3600.0}, failures_to_open=100)
    request = Request("b", PROMPT)
    valkey.pause()
    try:
        assert replica_2.remote.fetch(request) == 0
    finally:
        valkey.resume()
    assert replica_2.store.counters.timeouts == 1
    assert replica_2.remote.counters.misses_remembered == 0
    published_by_replica_1(valkey.port)
    assert replica_2.remote.fetch(request) == 5


def test_a_hash_this_replica_publishes_is_forgotten(valkey: ServerProcess) -> None:
    replica = Replica(valkey.port, remote={"miss_ttl_s": 3600.0})
    hashes = replica.allocator.block_hashes(Request("a", PROMPT), 0)
    assert replica.remote.fetch(Request("a", PROMPT)) == 0
    assert replica.remote.misses.first_missed(hashes) == 0
    replica.admit("a", PROMPT, seed=1)
    replica.allocator.free("a")
    replica.admit("filler", list(range(900, 900 + 7 * 4 - 3)), seed=2)  # evicts, publishes
    assert replica.remote.counters.published == 5
    assert replica.remote.misses.first_missed(hashes) == len(hashes)


def test_a_corrupt_value_is_remembered_as_a_miss(valkey: ServerProcess) -> None:
    published_by_replica_1(valkey.port)
    replica_2 = Replica(valkey.port)
    hashes = replica_2.allocator.block_hashes(Request("b", PROMPT), 0)
    client = redis.Redis(port=valkey.port, socket_timeout=2)
    key = replica_2.store.key_of(hashes[2])
    client.set(key, client.get(key)[:-1])  # truncated
    assert replica_2.remote.fetch(Request("b", PROMPT)) == 2
    asked = server_lookups(valkey)
    assert replica_2.remote.fetch(Request("b", PROMPT)) == 0  # blocks 0, 1 are local now
    assert server_lookups(valkey) == asked
    assert replica_2.store.counters.corrupt == 1


def test_what_the_memory_refuses() -> None:
    for ttl in (-1, float("nan"), float("inf"), True, "1"):
        with pytest.raises(AllocatorError, match="miss_ttl_s"):
            RecentMisses(ttl)  # type: ignore[arg-type]
    for capacity in (-1, 1.5, True):
        with pytest.raises(AllocatorError, match="miss_capacity"):
            RecentMisses(1.0, capacity)  # type: ignore[arg-type]


HASHES = [bytes([i]) * 32 for i in range(6)]
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("remember"), st.lists(st.sampled_from(HASHES), max_size=3)),
        st.tuples(st.just("forget"), st.lists(st.sampled_from(HASHES), max_size=2)),
        st.tuples(st.just("advance"), st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0])),
        st.tuples(st.just("ask"), st.permutations(HASHES)),
    ),
    max_size=40,
)


@settings(deadline=None)
@given(ttl=st.sampled_from([0.0, 0.5, 1.0]), capacity=st.integers(0, 8), ops=OPS)
def test_a_remembered_miss_is_recent_bounded_and_never_for_good(ttl, capacity, ops) -> None:
    """Against a model: a hash is reported missed only if it was remembered less than
    ``ttl`` ago and not forgotten since (never a miss for good); never more than
    ``capacity`` entries; with room for every hash, each recent miss is reported."""
    clock = Clock()
    misses = RecentMisses(ttl, capacity, clock)
    last_missed: dict[bytes, float] = {}  # hash -> when last remembered (not forgotten)
    for op, arg in ops:
        if op == "remember":
            misses.remember(arg)
            last_missed.update(dict.fromkeys(arg, clock.now))
        elif op == "forget":
            misses.forget(arg)
            for digest in arg:
                last_missed.pop(digest, None)
        elif op == "advance":
            clock.now += arg
        else:
            recent = {h for h, when in last_missed.items() if clock.now < when + ttl}
            index = misses.first_missed(arg)
            assert all(h not in recent or capacity < len(HASHES) for h in arg[:index])
            if index < len(arg):
                assert arg[index] in recent
        assert len(misses) <= capacity


def test_a_value_of_another_size_is_remembered_as_a_miss(valkey: ServerProcess) -> None:
    """A valid value (header and digest right) whose pages are longer than the local tiers'
    blocks (a namespace shared by another layout): a corrupt miss for the store (it reads no
    more than the largest block per key), remembered, so the next fetches do not ask for it
    again; the run before it is fetched."""
    published_by_replica_1(valkey.port)
    replica_2 = Replica(valkey.port)
    hashes = replica_2.allocator.block_hashes(Request("b", PROMPT), 0)
    client = redis.Redis(port=valkey.port, socket_timeout=2)
    key = replica_2.store.key_of(hashes[2])
    pages = replica_2.store.get_many([hashes[2]])[0]
    assert pages is not None
    client.set(key, encode_value(key, pages + b"\0" * 16))  # valid, 16 bytes too long
    assert replica_2.remote.fetch(Request("b", PROMPT)) == 2  # the run before block 2
    assert replica_2.store.counters.corrupt == 1
    assert replica_2.remote.counters.misses_remembered == 1
    assert replica_2.remote.misses.first_missed(hashes) == 2
    asked = server_lookups(valkey)
    assert replica_2.remote.fetch(Request("b", PROMPT)) == 0  # blocks 0, 1 are local now
    assert server_lookups(valkey) == asked  # block 2 not asked again
    assert replica_2.store.counters.corrupt == 1


def test_a_hybrids_fetch_meeting_remembered_misses_counts_once(valkey: ServerProcess) -> None:
    """Found in review: a fetch of a hybrid counted one remembered-miss hit per group (2 for
    one fetch), though the counter counts fetches, as fetches_not_asked does."""
    replica = HybridReplica(valkey.port)
    tokens = list(range(21))
    assert replica.remote.fetch(Request("a", tokens)) == 0  # nobody published: remembered
    assert replica.remote.fetch(Request("b", tokens)) == 0
    counters = replica.remote.counters
    assert (counters.remembered_miss_hits, counters.fetches_not_asked) == (1, 1)
