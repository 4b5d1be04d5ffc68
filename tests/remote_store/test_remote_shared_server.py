"""A hybrid's per-group stores share one server's breaker (issue 20 item 3): with the server
killed or hung, a 2-group hybrid (full attention + sliding window) pays ``failures_to_open``
failed calls in all, not per group, and once the server is back one call closes the breaker
for every group. Calls are counted (the stores' and the server's counters), never timed;
the breaker's clock is the test's."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replica_engine import BLOCK, HybridReplica
from test_remote_hybrid import PROMPT, WINDOW_BLOCKS, published_by_replica_1
from valkey_server import ServerProcess, free_port

from kvspec_core.runtime import Request
from kvspec_core.runtime.remote_store import (
    BlockNamespace,
    RemoteBlockStore,
    RemoteServer,
    RemoteStoreConfig,
)

FAILURES_TO_OPEN = 3
OPEN_FOR_S = 60.0
FETCHES = 4  # each asks both groups' stores: 8 calls while the server is down


def failed_calls(stores: list[RemoteBlockStore]) -> int:
    return sum(store.counters.errors + store.counters.timeouts for store in stores)


def down_replica(
    valkey: ServerProcess, failure: str, now: list[float], **options: object
) -> HybridReplica:
    """A 2-group replica whose server is then killed or hung (SIGSTOP), and ``FETCHES``
    fetches of the prompt: each fetch asks both groups' stores."""
    replica = HybridReplica(
        valkey.port,
        failures_to_open=FAILURES_TO_OPEN,
        open_for_s=OPEN_FOR_S,
        op_timeout_s=0.05,
        clock=lambda: now[0],
        **options,
    )
    assert len(replica.remote.stores) == 2
    if failure == "killed":
        valkey.kill()
    else:
        valkey.pause()
    for turn in range(FETCHES):
        assert replica.remote.fetch(Request(f"r{turn}", PROMPT)) == 0
    return replica


@pytest.mark.parametrize("failure", ["killed", "hung"])
def test_a_hybrid_learns_once_that_its_server_is_down_and_recovers_at_once(
    valkey: ServerProcess, failure: str
) -> None:
    now = [0.0]
    replica = down_replica(valkey, failure, now)
    stores = list(replica.remote.stores.values())
    assert failed_calls(stores) == FAILURES_TO_OPEN  # not FAILURES_TO_OPEN per group
    assert sum(store.counters.skipped for store in stores) == 2 * FETCHES - FAILURES_TO_OPEN
    assert sum(store.counters.breaker_opened for store in stores) == 1
    if failure == "hung":
        assert sum(store.counters.timeouts for store in stores) == FAILURES_TO_OPEN
    server = stores[0].server
    assert all(store.server is server for store in stores)
    assert server.counters.failed == FAILURES_TO_OPEN
    assert server.counters.calls == FAILURES_TO_OPEN
    assert server.counters.breaker_opened == 1 and server.counters.skipped == 5
    assert all(store.breaker_open for store in stores)
    assert all(not store.last_call_answered for store in stores)

    # The server comes back (killed: restarted empty on the same port); replica 1 publishes
    # the prompt. Past open_for_s the first call tries, is answered and closes the breaker
    # for both groups: this fetch gets both groups' blocks with no failure more.
    if failure == "killed":
        valkey.start()
    else:
        valkey.resume()
    published_by_replica_1(valkey.port)
    now[0] += OPEN_FOR_S
    assert replica.remote.fetch(Request("back", PROMPT)) == 5 + WINDOW_BLOCKS
    assert not any(store.breaker_open for store in stores)
    assert failed_calls(stores) == FAILURES_TO_OPEN
    assert server.counters.failed == FAILURES_TO_OPEN
    assert replica.allocator.find_cached_prefix(Request("back", PROMPT)).num_tokens == 5 * BLOCK
    replica.allocator.check_invariants()


def test_control_a_server_per_group_pays_the_failures_once_per_group(
    valkey: ServerProcess,
) -> None:
    """The count above tells the difference: stores on a server each (as the hybrid's
    stores were before) pay ``failures_to_open`` failed calls per group."""
    now = [0.0]
    replica = down_replica(valkey, "killed", now, shared_server=False)
    stores = list(replica.remote.stores.values())
    assert stores[0].server is not stores[1].server
    assert failed_calls(stores) == 2 * FAILURES_TO_OPEN
    assert sum(store.counters.breaker_opened for store in stores) == 2


def test_stores_on_one_server_keep_their_own_namespaces(valkey: ServerProcess) -> None:
    """Sharing the server shares no key: a block put under one group's namespace is no hit
    for the other's, and each store counts its own calls."""
    server = RemoteServer(RemoteStoreConfig(port=valkey.port))
    first = RemoteBlockStore(BlockNamespace.of(model="m", group=0), server)
    second = RemoteBlockStore(BlockNamespace.of(model="m", group=1), server)
    digest = bytes(range(32))
    assert first.put_many([(digest, b"pages of group 0")]) == 1
    assert second.get_many([digest]) == [None]
    assert first.get_many([digest]) == [b"pages of group 0"]
    assert first.key_of(digest) != second.key_of(digest)
    assert (first.counters.stored, first.counters.hits, first.counters.misses) == (1, 1, 0)
    assert (second.counters.stored, second.counters.hits, second.counters.misses) == (0, 0, 1)
    assert server.counters.calls == 3 and server.counters.failed == 0


def test_what_a_store_on_a_shared_server_refuses() -> None:
    server = RemoteServer(RemoteStoreConfig())
    namespace = BlockNamespace.of(model="m")
    with pytest.raises(TypeError, match="clock is the breaker's; a shared RemoteServer"):
        RemoteBlockStore(namespace, server, clock=lambda: 0.0)
    with pytest.raises(TypeError, match="server must be a RemoteServer or a RemoteStoreConfig"):
        RemoteBlockStore(namespace, {"port": 6379})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RemoteServer: config must be a RemoteStoreConfig"):
        RemoteServer({"port": 6379})  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    failures_to_open=st.integers(1, 4),
    calls=st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0.0, 0.4, 1.0])), max_size=25),
)
def test_stores_on_a_dead_server_fail_as_one_breaker_counts(
    failures_to_open: int, calls: list[tuple[int, float]]
) -> None:
    """Three stores on one server with nothing listening (each call refused), called in any
    order with the clock moving: the failed calls, skips and openings are those of one
    breaker over all the calls, and the stores' own counters add up to the server's."""
    now = [0.0]
    open_for_s = 1.0
    server = RemoteServer(
        RemoteStoreConfig(port=free_port(), failures_to_open=failures_to_open, open_for_s=1.0),
        clock=lambda: now[0],
    )
    stores = [RemoteBlockStore(BlockNamespace.of(model="m", group=gid), server) for gid in range(3)]
    # The model: one breaker (closed, open until a time, half open past it).
    in_a_row, open_until, failed, skipped, opened = 0, None, 0, 0, 0
    for index, advance in calls:
        now[0] += advance
        assert stores[index].contains_many([bytes(32)]) == [False]
        if open_until is not None and now[0] < open_until:
            skipped += 1
            continue
        failed += 1
        in_a_row += 1
        if open_until is not None or in_a_row >= failures_to_open:
            open_until, opened = now[0] + open_for_s, opened + 1
    counters = server.counters
    assert (counters.failed, counters.skipped, counters.breaker_opened) == (failed, skipped, opened)
    assert counters.calls == failed and counters.timeouts == 0
    assert sum(store.counters.errors for store in stores) == failed
    assert sum(store.counters.skipped for store in stores) == skipped
    assert sum(store.counters.breaker_opened for store in stores) == opened
