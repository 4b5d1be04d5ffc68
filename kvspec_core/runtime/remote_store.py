"""A block store shared by engine replicas, on an existing key-value server (Redis, Valkey).

Several engine processes, possibly on different machines, share prefix blocks through one
server: a prefix replica 1 computed (and offloaded here) is a remote hit for replica 2::

    namespace = BlockNamespace.of(layout=..., groups=..., pool=0, tp_rank=0)
    store = RemoteBlockStore(namespace, RemoteStoreConfig(host="10.0.0.5", port=6379))
    store.put_many([(block_hash, page_bytes), ...])   # -> how many were stored
    store.get_many([block_hash, ...])                 # -> [page_bytes | None, ...]
    store.contains_many([block_hash, ...])            # -> [bool, ...]
    store.counters                                    # hits, misses, errors, timeouts, ...

A hybrid model's per-group stores share one server, and with it the connections and the
breaker (``remote_server.py``)::

    server = RemoteServer(RemoteStoreConfig(host="10.0.0.5", port=6379))
    stores = {gid: RemoteBlockStore(namespace_of(gid), server) for gid in caching_groups}

**Keys** are ``kvspec/1/`` + the namespace's 16-byte digest + the salted chained block hash
(:mod:`kvspec_core.runtime.hashing`; the namespace: ``remote_namespace.py``). Replicas share
blocks only if their hashers share a salt (``PrefixHasher(block_size, salt=...)``; the
default salt is random per process).

**Values** are the block's pages behind a 48-byte header (``remote_values.py``). A value whose
header, length or digest does not match (truncated, flipped, written under another key,
another format) is a miss, counted in ``corrupt``: no partial or corrupt block ever comes back.

**Failures never reach the engine's step.** Each call has a total deadline: it ends, as a
timeout, at the latest ``connect_timeout_s + op_timeout_s + bytes / min_bytes_per_s`` after
it starts, ``bytes`` being what it has sent and received so far (a server that stops
answering or trickles its answer slower than ``min_bytes_per_s`` is cut there; a large block
on a link faster than that goes through; ``remote_deadline.py``). Outside that bound: the
client's CPU time after its last socket operation (decoding) and, when ``host`` is a name
rather than an address, its name resolution (give an address). Each call also bounds the
bytes it reads to what its answer can hold (a status or an integer per key; for
``get_many`` given ``max_payload_bytes``, a value of at most that size per key), so a server
that sends an endless answer, however fast, fails the call there instead of holding it and
filling the engine's memory. A server error, timeout, refused connection or any other failure inside
the client (a malformed answer) turns the call's results into misses (``False`` for
``contains_many``, ``0`` stored for ``put_many``), is counted and drops the connections, and
after ``failures_to_open`` failed calls in a row (of all the stores on the server) the
circuit breaker opens: for ``open_for_s`` seconds no call reaches the server (each is
counted in ``skipped``), then one call tries again (it closes the breaker if it succeeds).
Only a caller's mistake raises (a hash that is not bytes of the hash size, a payload that is
not bytes), checked before the call: that is a bug to fix, not a server to survive. The
client speaks RESP2 (no ``HELLO``: any Redis or Valkey version).

A store (with the other stores on its server) is used by one thread at a time (an engine's
scheduler); each process makes its own. The server decides what it keeps: give it
``maxmemory`` and ``maxmemory-policy allkeys-lru`` (or set ``ttl_s``) so that it evicts
instead of refusing writes.

Needs the ``redis`` client: ``pip install kvspec-core[remote]``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvspec_core.runtime.remote_namespace import KEY_PREFIX, NAMESPACE_DIGEST_SIZE, BlockNamespace
from kvspec_core.runtime.remote_server import (
    CallOutcome,
    CallStatus,
    RemoteServer,
    RemoteServerCounters,
    RemoteStoreConfig,
)
from kvspec_core.runtime.remote_values import (
    HEADER_SIZE,
    VALUE_FORMAT_VERSION,
    Pages,
    checked_pages,
    decode_value,
    encode_value,
)

#: Bytes a call may read beyond its replies: the answers to the commands a new connection
#: sends first (AUTH, SELECT, CLIENT SETINFO; errors included).
_HANDSHAKE_BYTES = 4096
#: Bytes of one reply to SET or EXISTS (a status, an integer or an error line): generous,
#: as servers' error lines differ.
_STATUS_REPLY_BYTES = 1024
#: RESP2 framing of one bulk string (``$`` + a length of up to 20 digits + two CRLFs), and of
#: the array around them.
_BULK_FRAMING_BYTES = 25
_ARRAY_FRAMING_BYTES = 25

__all__ = [
    "HEADER_SIZE",
    "KEY_PREFIX",
    "NAMESPACE_DIGEST_SIZE",
    "VALUE_FORMAT_VERSION",
    "BlockNamespace",
    "RemoteBlockStore",
    "RemoteServer",
    "RemoteServerCounters",
    "RemoteStoreConfig",
    "RemoteStoreCounters",
]


@dataclass
class RemoteStoreCounters:
    """What this store's own calls found (a snapshot: :attr:`RemoteBlockStore.counters`).
    The stores on one server each count their own calls; ``RemoteServer.counters`` counts
    all of them together."""

    #: Blocks ``get_many`` returned.
    hits: int = 0
    #: Blocks ``get_many`` did not return (absent, corrupt, or the call failed or was skipped).
    misses: int = 0
    #: Of the misses: values present but refused (header, length or digest wrong).
    corrupt: int = 0
    #: Blocks ``put_many`` stored.
    stored: int = 0
    #: Calls that failed on a server or connection error (timeouts not included), and
    #: ``put_many`` calls some of whose writes the server refused.
    errors: int = 0
    #: Calls that ran into a timeout.
    timeouts: int = 0
    #: Calls the open breaker (the server's, shared) kept from the server.
    skipped: int = 0
    #: Times a failed call of this store opened the server's breaker.
    breaker_opened: int = 0
    #: Value bytes received and sent (headers included).
    bytes_in: int = 0
    bytes_out: int = 0


class RemoteBlockStore:
    """Blocks of one namespace on a Redis/Valkey server; see the module's documentation.

    ``server``: a :class:`RemoteServer` shared with other stores (a hybrid's groups: one
    breaker, one connection pool), or a :class:`RemoteStoreConfig` (or None, the default
    config) for a server of this store's own, whose breaker runs on ``clock`` (seconds,
    monotonic; tests pass their own; a shared server has its own clock).
    """

    def __init__(
        self,
        namespace: BlockNamespace,
        server: RemoteServer | RemoteStoreConfig | None = None,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not isinstance(namespace, BlockNamespace):
            raise TypeError(
                f"RemoteBlockStore: namespace must be a BlockNamespace (BlockNamespace.of(...)), "
                f"not {type(namespace).__name__}"
            )
        if isinstance(server, RemoteServer):
            if clock is not None:
                raise TypeError(
                    "RemoteBlockStore: clock is the breaker's; a shared RemoteServer has its "
                    "own (RemoteServer(config, clock=...))"
                )
        elif server is None or isinstance(server, RemoteStoreConfig):
            server = RemoteServer(server) if clock is None else RemoteServer(server, clock=clock)
        else:
            raise TypeError(
                "RemoteBlockStore: server must be a RemoteServer or a RemoteStoreConfig, not "
                f"{type(server).__name__}"
            )
        self.namespace = namespace
        #: The server this store talks to (perhaps shared with other stores).
        self.server = server
        self.config = server.config
        self._key_prefix = namespace.key_prefix
        #: The block byte order bound by :meth:`bind_block_layout` (None: not bound).
        self.block_layout: str | None = None
        ttl_s = self.config.ttl_s
        self._ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._counters = RemoteStoreCounters()
        self._answered = False

    # -- public API ---------------------------------------------------------------------------

    @property
    def counters(self) -> RemoteStoreCounters:
        """A copy of this store's counters so far."""
        return RemoteStoreCounters(**vars(self._counters))

    @property
    def last_call_answered(self) -> bool:
        """Whether the last call reached the server and read its whole answer (False: it
        failed, timed out or the breaker kept it from the server, so its misses say nothing
        about what the server holds)."""
        return self._answered

    @property
    def breaker_open(self) -> bool:
        """True while the server's breaker keeps calls from it."""
        return self.server.breaker_open

    def bind_block_layout(self, layout: str) -> None:
        """Key this store's blocks under its namespace and ``layout``, what orders a block's
        bytes in the caller's storage (``RemoteTier`` binds its runner's
        ``TransferRunner.source_block_layout``): replicas whose views order a block's bytes
        differently (kernel-block views, a byte tensor) never read each other's values,
        whatever namespace their callers built. Binding again to another layout is refused
        (one store, one storage)."""
        if not isinstance(layout, str):
            raise TypeError(
                f"RemoteBlockStore.bind_block_layout: layout must be a str, not "
                f"{type(layout).__name__}"
            )
        if self.block_layout is not None:
            if layout != self.block_layout:
                raise ValueError(
                    "RemoteBlockStore.bind_block_layout: this store is bound to the block "
                    f"layout {self.block_layout!r}, not {layout!r}; give each storage its own "
                    "store"
                )
            return
        bound = BlockNamespace.of(namespace=self.namespace.digest, block_layout=layout)
        self._key_prefix = bound.key_prefix
        self.block_layout = layout

    def key_of(self, block_hash: bytes) -> bytes:
        """The server key of ``block_hash`` in this store's namespace."""
        return self._key_prefix + self._checked_hash(block_hash, "key_of", 0)

    def put_many(self, blocks: Iterable[tuple[bytes, Pages]]) -> int:
        """Store each ``(block hash, page bytes)`` (pipelined, one round trip); return how many
        the server took (0 when it is down, slow or the breaker is open)."""
        keyed = [
            (self._key_prefix + self._checked_hash(block_hash, "put_many", index), payload)
            for index, (block_hash, payload) in enumerate(blocks)
        ]
        values = [
            encode_value(key, checked_pages(payload, index))
            for index, (key, payload) in enumerate(keyed)
        ]
        if not values:
            self._answered = True  # nothing to ask
            return 0

        def run(pipe: Any) -> list[Any]:
            for (key, _), value in zip(keyed, values, strict=True):
                pipe.set(key, value, px=self._ttl_ms)
            return pipe.execute(raise_on_error=False)

        replies = self._call(run, len(values), _status_replies(len(values)))
        if replies is None:
            return 0
        stored = 0
        for reply, value in zip(replies, values, strict=True):
            if reply is True:
                stored += 1
                self._counters.bytes_out += len(value)
        self._counters.stored += stored
        if stored < len(values):
            self._counters.errors += 1  # the server refused some (e.g. out of memory)
        return stored

    def get_many(
        self, block_hashes: Sequence[bytes], *, max_payload_bytes: int | None = None
    ) -> list[bytes | None]:
        """Each block's page bytes, or None where the server has none, has a corrupt one, is
        down or slow, or the breaker is open (one pipelined MGET).

        ``max_payload_bytes``: the largest block the caller can use (its tiers' block
        bytes). A longer value is a miss (counted in ``corrupt``), and the call reads at
        most what one value of that size per key takes: a server sending more fails it.
        None: values of any size (the call's deadline still bounds it)."""
        keys = [
            self._key_prefix + self._checked_hash(block_hash, "get_many", index)
            for index, block_hash in enumerate(block_hashes)
        ]
        if max_payload_bytes is not None and (
            isinstance(max_payload_bytes, bool)
            or not isinstance(max_payload_bytes, int)
            or max_payload_bytes < 0
        ):
            raise ValueError(
                f"RemoteBlockStore.get_many: max_payload_bytes={max_payload_bytes!r} must be an "
                "int >= 0 (the tiers' block bytes) or None"
            )
        if not keys:
            self._answered = True
            return []
        max_reply = None
        if max_payload_bytes is not None:
            value_reply = HEADER_SIZE + max_payload_bytes + _BULK_FRAMING_BYTES
            max_reply = _HANDSHAKE_BYTES + _ARRAY_FRAMING_BYTES + len(keys) * value_reply
        values = self._call(_values_of_mget(keys), len(keys), max_reply)
        if values is None:
            self._counters.misses += len(keys)
            return [None] * len(keys)
        found: list[bytes | None] = []
        for key, value in zip(keys, values, strict=True):
            payload = None
            if value is not None:
                self._counters.bytes_in += len(value)
                too_long = (
                    max_payload_bytes is not None and len(value) > HEADER_SIZE + max_payload_bytes
                )
                payload = None if too_long else decode_value(key, value)
                if payload is None:
                    self._counters.corrupt += 1
            if payload is None:
                self._counters.misses += 1
            else:
                self._counters.hits += 1
            found.append(payload)
        return found

    def contains_many(self, block_hashes: Sequence[bytes]) -> list[bool]:
        """Whether the server has a value under each hash (pipelined EXISTS; False when it is
        down, slow or the breaker is open). A hint: the value is checked only by
        :meth:`get_many`, which may still miss."""
        keys = [
            self._key_prefix + self._checked_hash(block_hash, "contains_many", index)
            for index, block_hash in enumerate(block_hashes)
        ]
        if not keys:
            self._answered = True
            return []

        def run(pipe: Any) -> list[Any]:
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        replies = self._call(run, len(keys), _status_replies(len(keys)))
        if replies is None:
            return [False] * len(keys)
        return [reply == 1 for reply in replies]

    def contained_prefix_length(self, block_hashes: Sequence[bytes]) -> int:
        """How many of the chain's leading blocks the server has (:meth:`contains_many`)."""
        length = 0
        for present in self.contains_many(block_hashes):
            if not present:
                break
            length += 1
        return length

    def close(self) -> None:
        """Close the server's connections (shared with the other stores on it; all can still
        be used: they reconnect)."""
        self.server.close()

    # -- internals ----------------------------------------------------------------------------

    def _checked_hash(self, block_hash: object, method: str, index: int) -> bytes:
        if not isinstance(block_hash, bytes) or len(block_hash) != self.config.hash_size:
            raise TypeError(
                f"RemoteBlockStore.{method}: block hash [{index}] must be {self.config.hash_size} "
                f"bytes (a PrefixHasher hash), not {type(block_hash).__name__}"
                + (f" of {len(block_hash)} bytes" if isinstance(block_hash, bytes) else "")
            )
        return block_hash

    def _call(
        self, run: Callable[[Any], Any], num_replies: int, max_reply_bytes: int | None
    ) -> list[Any] | None:
        """The server's ``num_replies`` replies to ``run(pipeline)``, or None if the call
        was skipped, failed (a server sending more than ``max_reply_bytes`` fails it) or
        answered with another count (this store's counters say which)."""
        outcome: CallOutcome = self.server.pipelined(run, max_reply_bytes)
        counters = self._counters
        if outcome.status is CallStatus.SKIPPED:
            counters.skipped += 1
        elif outcome.status is CallStatus.TIMED_OUT:
            counters.timeouts += 1
        elif outcome.status is CallStatus.FAILED:
            counters.errors += 1
        counters.breaker_opened += outcome.opened_breaker
        answer = outcome.answer
        self._answered = (
            outcome.status is CallStatus.ANSWERED
            and isinstance(answer, list)
            and len(answer) == num_replies
        )
        return answer if self._answered else None


class MalformedAnswer(Exception):
    """The server answered with something no conforming server sends for that command."""


def _values_of_mget(keys: list[bytes]) -> Callable[[Any], list[Any]]:
    """``run(pipeline)`` for ``pipelined``: MGET's values, each bytes or None. Anything else
    (integers, a per-key error a sharding proxy nests in the array, a nested array) fails the
    whole call, so the breaker hears of it and no element is read as a value."""

    def run(pipe: Any) -> list[Any]:
        answer = pipe.mget(keys).execute()[0]
        if not isinstance(answer, list) or not all(
            value is None or value.__class__ is bytes for value in answer
        ):
            raise MalformedAnswer("MGET answered with elements that are neither values nor nil")
        return answer

    return run


def _status_replies(num_keys: int) -> int:
    """The most bytes the answer to ``num_keys`` pipelined SETs or EXISTS can take."""
    return _HANDSHAKE_BYTES + num_keys * _STATUS_REPLY_BYTES
