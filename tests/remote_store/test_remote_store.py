"""The remote block store against a real Valkey server on loopback (issue 20 item 3): replicas
share blocks, namespaces isolate, corrupt values are misses, a killed or hung server costs
misses within the timeout (never an exception, never a hang) and the store recovers."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replica_process import offload_prompt
from valkey_server import ServerProcess, free_port

from kvspec_core.runtime import PrefixHasher, Request
from kvspec_core.runtime.remote_store import (
    HEADER_SIZE,
    BlockNamespace,
    RemoteBlockStore,
    RemoteStoreConfig,
)
from kvspec_core.runtime.remote_values import decode_value, encode_value

LLAMA = {"checksum:layout": "3f0a", "checksum:groups[0].spec": "91bc", "pool": 0, "tp_rank": 0}
#: Slack on top of a deadline for a loaded CI machine (two cores shared by many processes):
#: these bounds prove "ends by its deadline, never hangs", not speed, so they are generous.
SLACK_S = 5.0


def block_hash(index: int) -> bytes:
    return index.to_bytes(4, "little") * 8


def store_on(server: ServerProcess, parts: dict = LLAMA, **config: object) -> RemoteBlockStore:
    return RemoteBlockStore(
        BlockNamespace.of(**parts), RemoteStoreConfig(port=server.port, **config)
    )


def raw_client(server: ServerProcess) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=2)


def test_a_block_one_replica_stores_is_a_hit_for_another(valkey: ServerProcess) -> None:
    writer, reader = store_on(valkey), store_on(valkey)
    blocks = [(block_hash(i), bytes([i]) * (1000 + i)) for i in range(8)]

    assert writer.put_many(blocks) == 8
    assert reader.get_many([h for h, _ in blocks]) == [pages for _, pages in blocks]
    assert reader.contains_many([block_hash(3), block_hash(99)]) == [True, False]
    assert reader.contained_prefix_length([block_hash(0), block_hash(1), block_hash(99)]) == 2
    assert reader.get_many([block_hash(99)]) == [None]
    counters = reader.counters
    assert (counters.hits, counters.misses, counters.corrupt, counters.errors) == (8, 1, 0, 0)
    assert counters.bytes_in == sum(HEADER_SIZE + len(p) for _, p in blocks)
    assert writer.counters.stored == 8
    assert writer.counters.bytes_out == counters.bytes_in


def test_a_prefix_one_process_computed_is_a_remote_hit_in_another(valkey: ServerProcess) -> None:
    """Two engine processes: replica 1 (a spawned interpreter) hashes a prompt and offloads its
    blocks; replica 2 hashes the same prompt with the shared salt and gets the same bytes."""
    salt, tokens, block_size = b"fleet-salt", list(range(1000, 1000 + 16 * 5 + 3)), 16
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    replica_1 = context.Process(
        target=offload_prompt, args=(valkey.port, salt, tokens, block_size, LLAMA, results)
    )
    replica_1.start()
    try:
        hashes, pages, stored = results.get(timeout=60)
    finally:
        replica_1.join(timeout=60)
    assert replica_1.exitcode == 0 and stored == 5

    replica_2 = store_on(valkey)
    own_hashes = PrefixHasher(block_size, salt=salt).hashes(Request("r", tokens), len(tokens))
    assert own_hashes == hashes
    assert replica_2.get_many(own_hashes) == pages
    # Without the shared salt (each process's own random one) nothing is shared.
    unsalted = PrefixHasher(block_size).hashes(Request("r", tokens), len(tokens))
    assert replica_2.contains_many(unsalted) == [False] * 5


def test_a_replica_of_another_model_never_hits(valkey: ServerProcess) -> None:
    llama = store_on(valkey)
    others = [
        store_on(valkey, {**LLAMA, "checksum:layout": "77aa"}),  # another model or layout
        store_on(valkey, {**LLAMA, "pool": 1}),  # another pool of the same plan
        store_on(valkey, {**LLAMA, "tp_rank": 1}),  # another tensor-parallel rank
        store_on(valkey, {**LLAMA, "pool": "0"}),  # the str "0" is not the int 0
    ]
    assert llama.put_many([(block_hash(1), b"llama pages")]) == 1
    for other in others:
        assert other.contains_many([block_hash(1)]) == [False]
        assert other.get_many([block_hash(1)]) == [None]
        assert other.counters.corrupt == 0  # a different key, not a refused value
    assert llama.get_many([block_hash(1)]) == [b"llama pages"]


def test_a_value_moved_under_another_key_is_refused(valkey: ServerProcess) -> None:
    """The digest covers the key: a value copied to another hash or namespace is a miss."""
    llama, other = store_on(valkey), store_on(valkey, {**LLAMA, "tp_rank": 1})
    llama.put_many([(block_hash(1), b"block one")])
    client = raw_client(valkey)
    value = client.get(llama.key_of(block_hash(1)))
    client.set(llama.key_of(block_hash(2)), value)
    client.set(other.key_of(block_hash(1)), value)

    assert llama.get_many([block_hash(2)]) == [None]
    assert other.get_many([block_hash(1)]) == [None]
    assert llama.counters.corrupt == 1 and other.counters.corrupt == 1


def flip(value: bytes, index: int, mask: int = 1) -> bytes:
    return value[:index] + bytes([value[index] ^ mask]) + value[index + 1 :]


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda v: v[:-1], id="payload truncated by one byte"),
        pytest.param(lambda v: v[: HEADER_SIZE // 2], id="header truncated"),
        pytest.param(lambda v: b"", id="empty"),
        pytest.param(lambda v: v + b"\x00", id="a byte appended"),
        pytest.param(lambda v: flip(v, len(v) - 1), id="last payload bit flipped"),
        pytest.param(lambda v: flip(v, HEADER_SIZE, 0x80), id="first payload bit flipped"),
        pytest.param(lambda v: flip(v, 0), id="magic flipped"),
        pytest.param(lambda v: v[:4] + b"\x02\x00" + v[6:], id="another format version"),
        pytest.param(lambda v: flip(v, HEADER_SIZE - 1), id="digest flipped"),
    ],
)
def test_a_corrupt_value_is_a_counted_miss(valkey: ServerProcess, damage) -> None:
    store = store_on(valkey)
    pages = bytes(range(256)) * 16
    store.put_many([(block_hash(1), pages), (block_hash(2), pages)])
    client = raw_client(valkey)
    key = store.key_of(block_hash(1))
    client.set(key, damage(client.get(key)))

    assert store.get_many([block_hash(1), block_hash(2)]) == [None, pages]
    counters = store.counters
    assert (counters.hits, counters.misses, counters.corrupt) == (1, 1, 1)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(payloads=st.lists(st.binary(max_size=3000), min_size=1, max_size=6))
def test_any_bytes_round_trip(valkey: ServerProcess, payloads: list[bytes]) -> None:
    store = store_on(valkey)
    hashes = [block_hash(i) for i in range(len(payloads))]
    assert store.put_many(list(zip(hashes, payloads, strict=True))) == len(payloads)
    assert store.get_many(hashes) == payloads


@settings(deadline=None)  # a shared 2-core machine: no per-example deadline
@given(payload=st.binary(max_size=300), data=st.data())
def test_no_truncation_or_bit_flip_of_a_value_decodes(payload: bytes, data: st.DataObject) -> None:
    key = b"kvspec/1/" + bytes(48)
    value = encode_value(key, payload)
    assert decode_value(key, value) == payload
    cut = data.draw(st.integers(0, len(value) - 1), label="truncated to")
    assert decode_value(key, value[:cut]) is None
    bit = data.draw(st.integers(0, 8 * len(value) - 1), label="bit flipped")
    flipped = bytearray(value)
    flipped[bit // 8] ^= 1 << (bit % 8)
    # The reserved field is checked too, so every bit of header and payload counts.
    assert decode_value(key, bytes(flipped)) is None


NAMESPACE_PARTS = st.dictionaries(
    st.sampled_from("abc"),
    st.one_of(st.integers(-2, 2), st.text(max_size=2), st.binary(max_size=2)),
    min_size=1,
)


@settings(deadline=None)  # a shared 2-core machine: no per-example deadline
@given(first=NAMESPACE_PARTS, second=NAMESPACE_PARTS)
def test_namespaces_are_equal_exactly_when_their_parts_are(first: dict, second: dict) -> None:
    same = first.keys() == second.keys() and all(
        type(first[k]) is type(second[k]) and first[k] == second[k] for k in first
    )
    assert (BlockNamespace.of(**first) == BlockNamespace.of(**second)) == same


def test_a_killed_server_costs_misses_within_the_timeout_then_the_store_recovers(
    valkey: ServerProcess,
) -> None:
    store = store_on(valkey, failures_to_open=3, open_for_s=0.5)
    assert store.put_many([(block_hash(1), b"one")]) == 1
    valkey.kill()

    for _ in range(3):  # each fails on its own, within the timeouts
        started = time.monotonic()
        assert store.get_many([block_hash(1), block_hash(2)]) == [None, None]
        assert time.monotonic() - started < 0.05 + 0.2 + SLACK_S
    assert store.breaker_open
    counters = store.counters
    assert counters.errors + counters.timeouts == 3 and counters.breaker_opened == 1

    # Open: no call reaches the (absent) server; each is a counted skip (the counters below
    # prove it; the clock only that none waited for a timeout and a slack).
    started = time.monotonic()
    assert store.put_many([(block_hash(3), b"three")]) == 0
    assert store.contains_many([block_hash(1)]) == [False]
    assert store.get_many([block_hash(1)]) == [None]
    assert time.monotonic() - started < SLACK_S
    counters = store.counters
    assert counters.skipped == 3 and counters.errors + counters.timeouts == 3
    assert counters.misses == 2 * 3 + 1

    # The server comes back on the same port, empty (no persistence); after the back-off the
    # next call reaches it and closes the breaker.
    valkey.start()
    time.sleep(0.5)
    assert store.get_many([block_hash(1)]) == [None]
    assert not store.breaker_open
    assert store.put_many([(block_hash(1), b"one again")]) == 1
    assert store.get_many([block_hash(1)]) == [b"one again"]
    assert store.counters.errors + store.counters.timeouts == 3


def test_a_failure_while_half_open_opens_the_breaker_again(tmp_path) -> None:
    now = [0.0]
    store = RemoteBlockStore(
        BlockNamespace.of(**LLAMA),
        RemoteStoreConfig(port=free_port(), failures_to_open=2, open_for_s=10.0),  # no server
        clock=lambda: now[0],
    )
    for _ in range(2):
        assert store.contains_many([block_hash(1)]) == [False]
    assert store.breaker_open and store.counters.errors == 2
    now[0] = 9.9
    assert store.get_many([block_hash(1)]) == [None] and store.counters.skipped == 1
    now[0] = 10.0  # half open: one call tries, fails, and the breaker opens for 10 s more
    assert store.get_many([block_hash(1)]) == [None]
    assert store.counters.errors == 3 and store.counters.breaker_opened == 2
    now[0] = 19.9
    assert store.put_many([(block_hash(1), b"x")]) == 0 and store.counters.skipped == 2


def test_a_hung_server_costs_a_timeout_not_a_hang(valkey: ServerProcess) -> None:
    store = store_on(valkey, op_timeout_s=0.1, failures_to_open=100)
    assert store.put_many([(block_hash(1), b"one")]) == 1
    valkey.pause()  # SIGSTOP: the kernel still accepts connections, nothing answers
    try:
        for call in (
            lambda: store.get_many([block_hash(1)]) == [None],
            lambda: store.contains_many([block_hash(1)]) == [False],
            lambda: store.put_many([(block_hash(2), b"two")]) == 0,
        ):
            started = time.monotonic()
            assert call()
            assert time.monotonic() - started < 0.1 + SLACK_S
    finally:
        valkey.resume()
    assert store.counters.timeouts == 3 and store.counters.errors == 0
    # Resumed: the late replies of the abandoned calls are never read as this call's.
    assert store.get_many([block_hash(1), block_hash(2)]) == [b"one", None]
    assert store.contains_many([block_hash(1)]) == [True]


def test_a_server_out_of_memory_refuses_writes_and_the_store_counts_them(
    valkey: ServerProcess,
) -> None:
    store = store_on(valkey)
    client = raw_client(valkey)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # every write refused
    assert store.put_many([(block_hash(1), b"x" * 1000), (block_hash(2), b"y")]) == 0
    assert store.counters.errors == 1 and store.counters.stored == 0
    client.config_set("maxmemory", 0)
    assert store.put_many([(block_hash(1), b"x")]) == 1


def test_blocks_expire_after_the_configured_ttl(valkey: ServerProcess) -> None:
    store = store_on(valkey, ttl_s=0.05)
    store.put_many([(block_hash(1), b"one")])
    time.sleep(0.1)
    assert store.get_many([block_hash(1)]) == [None]


def test_caller_mistakes_raise_and_name_the_argument() -> None:
    store = RemoteBlockStore(BlockNamespace.of(**LLAMA), RemoteStoreConfig(port=free_port()))
    with pytest.raises(TypeError, match=r"get_many: block hash \[1\] must be 32 bytes.*of 3"):
        store.get_many([block_hash(0), b"abc"])
    with pytest.raises(TypeError, match=r"contains_many: block hash \[0\].*not str"):
        store.contains_many(["ab" * 16])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"put_many: block \[0\]'s pages must be bytes.*not list"):
        store.put_many([(block_hash(0), [1, 2])])  # type: ignore[list-item]
    assert store.counters == type(store.counters)()  # nothing was sent, nothing counted
    with pytest.raises(ValueError, match="at least one part"):
        BlockNamespace.of()
    with pytest.raises(TypeError, match=r"part pool=True must be a str, bytes or int"):
        BlockNamespace.of(pool=True)
    with pytest.raises(ValueError, match=r"op_timeout_s=0 must be a positive number"):
        RemoteStoreConfig(op_timeout_s=0)
    with pytest.raises(ValueError, match=r"failures_to_open=0 must be an int >= 1"):
        RemoteStoreConfig(failures_to_open=0)
