"""The store against servers that misbehave on purpose (misbehaving_server.py; review s26
findings 1, 2 and 5): an answer trickled byte by byte ends at the call's deadline, not when
the server stops; a large block to a slow reader goes through when the link is faster than
``min_bytes_per_s`` and is cut when it is not; a malformed answer (redis-py raising what is
not a RedisError) is a counted miss, never an exception; a server without ``HELLO`` (Redis
before 6) is served; an endless answer sent faster than ``min_bytes_per_s`` fails the call
once it is longer than the answer can be, and a value longer than the caller's largest block
is a miss.

Time bounds here prove "ends by the deadline, not with the server", so they carry a
generous slack for a loaded machine; the trickling server keeps going far beyond it."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
from misbehaving_server import CommandReader, answer_simply, misbehaving_server
from valkey_server import ServerProcess

from kvspec_core.runtime.remote_store import BlockNamespace, RemoteBlockStore, RemoteStoreConfig

pytest.importorskip("redis", reason="the remote store's client (kvspec-core[remote])")

#: Slack on top of a deadline: a loaded 2-core CI machine, many processes.
SLACK_S = 5.0
#: How long the trickling server keeps answering: far past deadline + slack.
TRICKLE_FOR_S = 20.0
HASH = b"h" * 32


def store_at(port: int, **config: object) -> RemoteBlockStore:
    return RemoteBlockStore(
        BlockNamespace.of(model="m"),
        RemoteStoreConfig(port=port, failures_to_open=100, **config),  # type: ignore[arg-type]
    )


def next_lookup(connection: socket.socket, reader: CommandReader) -> bytes:
    """Answer the client's commands simply up to its first MGET or EXISTS: that name."""
    while True:
        command = reader.command()
        name = command[0].upper()
        if name in (b"MGET", b"EXISTS"):
            return name
        connection.sendall(answer_simply(command))


def trickle(connection: socket.socket, reader: CommandReader) -> None:
    """Answers MGET with a 100,000-byte value and EXISTS with an integer that never ends,
    one byte per 50 ms, for TRICKLE_FOR_S."""
    name = next_lookup(connection, reader)
    connection.sendall(b"*1\r\n$100000\r\n" if name == b"MGET" else b":")
    started = time.monotonic()
    while time.monotonic() - started < TRICKLE_FOR_S:
        connection.sendall(b"1")
        time.sleep(0.05)


def test_a_trickled_answer_ends_at_the_call_deadline() -> None:
    with misbehaving_server(trickle) as port:
        store = store_at(port)
        deadline = store.config.connect_timeout_s + store.config.op_timeout_s
        for call, missed in (
            (lambda: store.get_many([HASH]), [None]),
            (lambda: store.contains_many([HASH]), [False]),
        ):
            started = time.monotonic()
            assert call() == missed
            assert time.monotonic() - started < deadline + SLACK_S
            assert not store.last_call_answered
        assert store.counters.timeouts == 2 and store.counters.errors == 0


def ok_to_everything(connection: socket.socket, reader: CommandReader) -> None:
    while True:
        connection.sendall(answer_simply(reader.command()))


def test_a_large_block_to_a_slow_reader_is_bounded_by_bytes_not_by_one_timeout() -> None:
    """The reader takes 16 KiB per 5 ms (at most about 3 MB/s): a 4 MiB block needs over a
    second, far more than op_timeout_s (0.2 s), which alone cut it before."""
    block = bytes(4 << 20)
    with misbehaving_server(ok_to_everything, chunk=16384, pause_s=0.005) as port:
        # The link (>= 0.1 MB/s even on a loaded machine) is faster than the minimum: stored.
        patient = store_at(port, min_bytes_per_s=100_000.0)
        assert patient.put_many([(HASH, block)]) == 1
        assert patient.counters.timeouts == 0 and patient.last_call_answered
        # A minimum above the link's rate: the call is cut, as a counted timeout.
        impatient = store_at(port, min_bytes_per_s=1e9)
        assert impatient.put_many([(HASH, block)]) == 0
        assert impatient.counters.timeouts == 1


def malformed(connection: socket.socket, reader: CommandReader) -> None:
    """A bulk string whose length is not a number: redis-py raises ValueError."""
    while True:
        reader.command()
        connection.sendall(b"$x\r\n")


def test_a_malformed_answer_is_a_counted_miss_not_an_exception() -> None:
    with misbehaving_server(malformed) as port:
        store = store_at(port)
        assert store.get_many([HASH]) == [None]
        assert store.contains_many([HASH]) == [False]
        assert store.put_many([(HASH, b"pages")]) == 0
        assert not store.last_call_answered
        counters = store.counters
        assert (counters.errors, counters.timeouts, counters.misses) == (3, 0, 1)


def without_hello(connection: socket.socket, reader: CommandReader) -> None:
    """A Redis before 6: HELLO is an unknown command."""
    while True:
        command = reader.command()
        if command[0].upper() == b"HELLO":
            connection.sendall(b"-ERR unknown command 'HELLO'\r\n")
        else:
            connection.sendall(answer_simply(command))


@pytest.mark.parametrize(
    "element",
    [b":7\r\n", b"-ERR upstream shard failed\r\n", b"*1\r\n$1\r\nx\r\n"],
    ids=["integer", "nested error", "nested array"],
)
def test_mget_elements_that_are_not_values_fail_the_call_never_raise(element: bytes) -> None:
    """Found in review: an MGET array of the right length holding integers or per-key errors
    (a sharding proxy nests them) raised TypeError into the engine's step, and the breaker
    never heard of it."""

    def answer(connection: socket.socket, reader: CommandReader) -> None:
        while True:
            command = reader.command()
            if command[0].upper() == b"MGET":
                count = len(command) - 1
                connection.sendall(b"*%d\r\n" % count + element * count)
            else:
                connection.sendall(answer_simply(command))

    with misbehaving_server(answer) as port:
        store = store_at(port)
        assert store.get_many([HASH, HASH], max_payload_bytes=64) == [None, None]
        assert not store.last_call_answered
        counters = store.counters
        assert counters.errors == 1 and counters.misses == 2 and counters.hits == 0
        assert store.server.counters.failed == 1
        store.close()


def test_a_server_without_hello_is_served() -> None:
    with misbehaving_server(without_hello) as port:
        store = store_at(port)
        assert store.contains_many([HASH]) == [True]
        assert store.put_many([(HASH, b"pages")]) == 1
        assert store.counters.errors == 0 and store.last_call_answered


#: What the flooding server offers at most: far beyond any answer's bound, small enough that
#: a client without the bound reads it all (and the test fails) in a few seconds.
FLOOD_BYTES = 256 << 20


def flood(sent: list[int]) -> Callable[[socket.socket, CommandReader], None]:
    """A server that answers MGET with a value it claims is 1 GB long and EXISTS with an
    integer that never ends, sending as fast as the client reads, up to FLOOD_BYTES; counts
    what it sent into ``sent``."""

    def serve(connection: socket.socket, reader: CommandReader) -> None:
        name = next_lookup(connection, reader)
        connection.sendall(b"*1\r\n$1000000000\r\n" if name == b"MGET" else b":")
        chunk = b"1" * (1 << 20)
        total = 0
        try:
            while total < FLOOD_BYTES:
                connection.sendall(chunk)
                total += len(chunk)
        finally:
            sent.append(total)

    return serve


def test_an_endless_answer_sent_fast_fails_the_call_at_its_bound() -> None:
    """The deadline grows with the bytes moved, so only a bound on the bytes read stops a
    server that sends faster than min_bytes_per_s: each call reads at most what its answer
    can hold (a value of max_payload_bytes per key; an integer per key), then fails as an
    error, before the server could send a tenth of what it offered."""
    sent: list[int] = []
    with misbehaving_server(flood(sent)) as port:
        store = store_at(port)
        assert store.get_many([HASH, HASH], max_payload_bytes=4096) == [None, None]
        assert not store.last_call_answered
        assert store.contains_many([HASH]) == [False]
        assert not store.last_call_answered
        counters = store.counters
        assert (counters.errors, counters.timeouts, counters.misses) == (2, 0, 2)
        for _ in range(100):  # each connection's thread records what it sent on its way out
            if len(sent) == 2:
                break
            time.sleep(0.05)
    # What the kernel's socket buffers took before the client closed, not the 256 MiB.
    assert len(sent) == 2 and max(sent) < FLOOD_BYTES // 8, sent


def test_a_value_longer_than_the_largest_block_is_a_miss(valkey: ServerProcess) -> None:
    """A value under the key that is longer than the caller can use (another layout under a
    namespace it shares) is a counted corrupt miss; the call is answered, the breaker not
    told."""
    store = RemoteBlockStore(BlockNamespace.of(model="m"), RemoteStoreConfig(port=valkey.port))
    other = b"o" * 32
    assert store.put_many([(HASH, b"p" * 100), (other, b"q" * 50)]) == 2
    assert store.get_many([HASH, other], max_payload_bytes=64) == [None, b"q" * 50]
    assert store.last_call_answered
    assert (store.counters.corrupt, store.counters.errors) == (1, 0)
    assert store.get_many([HASH, other]) == [b"p" * 100, b"q" * 50]
    with pytest.raises(ValueError, match="max_payload_bytes=-1 must be an int >= 0"):
        store.get_many([HASH], max_payload_bytes=-1)
