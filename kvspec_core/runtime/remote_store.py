"""A block store shared by engine replicas, on an existing key-value server (Redis, Valkey).

Several engine processes, possibly on different machines, share prefix blocks through one
server: a prefix replica 1 computed (and offloaded here) is a remote hit for replica 2::

    namespace = BlockNamespace.of(layout=..., groups=..., pool=0, tp_rank=0)
    store = RemoteBlockStore(namespace, RemoteStoreConfig(host="10.0.0.5", port=6379))
    store.put_many([(block_hash, page_bytes), ...])   # -> how many were stored
    store.get_many([block_hash, ...])                 # -> [page_bytes | None, ...]
    store.contains_many([block_hash, ...])            # -> [bool, ...]
    store.counters                                    # hits, misses, errors, timeouts, ...

**Keys** are ``kvspec/1/`` + the namespace's 16-byte digest + the salted chained block hash
(:mod:`kvspec_core.runtime.hashing`). The namespace says what a block's bytes mean: the
caller builds it from whatever fixes the page layout (the plan's ``input_checksums`` of the
layout and of each group's layers and spec, the pool index, the tensor-parallel rank, ...),
so a replica of another model, layout or rank never reads these bytes as its own. Replicas
share blocks only if their hashers share a salt (``PrefixHasher(block_size, salt=...)``; the
default salt is random per process).

**Values** are the block's pages behind a 48-byte header: magic ``KVSB``, format version,
payload length, and BLAKE2b-256 of key and payload. A value whose header, length or digest
does not match (truncated, flipped, written under another key, another format) is a miss,
counted in ``corrupt``: no partial or corrupt block ever comes back.

**Failures never reach the engine's step.** Each call has a total deadline: it ends, as a
timeout, at the latest ``connect_timeout_s + op_timeout_s + bytes / min_bytes_per_s`` after
it starts, ``bytes`` being what it has sent and received so far (a server that stops
answering or trickles its answer slower than ``min_bytes_per_s`` is cut there; a large block
on a link faster than that goes through). Outside that bound: the client's CPU time after
its last socket operation (decoding) and, when ``host`` is a name rather than an address,
its name resolution (give an address). The bound counts the answer's bytes, so a server that
keeps sending an endless answer faster than ``min_bytes_per_s`` holds the call while it
sends: the store trusts the server to answer what was asked (it never trusts its values). A
server error, timeout, refused connection or any other failure inside the client (a
malformed answer) turns the call's results into misses (``False`` for ``contains_many``,
``0`` stored for ``put_many``), is counted and drops the connections, and after
``failures_to_open`` failed calls in a row the circuit breaker opens: for ``open_for_s``
seconds no call reaches the server (each is counted in ``skipped``), then one call tries
again (it closes the breaker if it succeeds). Only a caller's mistake raises (a hash that is
not bytes of the hash size, a payload that is not bytes), checked before the call: that is a
bug to fix, not a server to survive. The client speaks RESP2 (no ``HELLO``: any Redis or
Valkey version).

A store is used by one thread at a time (an engine's scheduler); each process makes its own.
The server decides what it keeps: give it ``maxmemory`` and ``maxmemory-policy allkeys-lru``
(or set ``ttl_s``) so that it evicts instead of refusing writes.

Needs the ``redis`` client: ``pip install kvspec-core[remote]``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import socket
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from kvspec_core.runtime.hashing import DIGEST_SIZE

if TYPE_CHECKING:
    import redis

#: Bytes of a namespace digest in a key.
NAMESPACE_DIGEST_SIZE: Final = 16
#: Every key of this store starts with it (its format version is the ``1``).
KEY_PREFIX: Final = b"kvspec/1/"
#: Version of the value format (the header below); a value of another version is a miss.
VALUE_FORMAT_VERSION: Final = 1

_MAGIC = b"KVSB"
# magic, format version, reserved (0), payload length, BLAKE2b-256(key || payload).
_HEADER = struct.Struct("<4sHHQ32s")
#: Bytes of a value's header.
HEADER_SIZE: Final = _HEADER.size

# Type tags of a namespace part's value: the str "1", the bytes b"1" and the int 1 differ.
_STR_TAG, _BYTES_TAG, _INT_TAG = b"s", b"b", b"i"


def _length_prefixed(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


@dataclass(frozen=True)
class BlockNamespace:
    """What the bytes of a block mean: the part of a key that keeps models, layouts, pools
    and ranks apart. Build it with :meth:`of`; two namespaces are equal exactly when they
    were built of the same parts."""

    digest: bytes

    @classmethod
    def of(cls, **parts: str | bytes | int) -> BlockNamespace:
        """The namespace of these named parts (their order does not matter).

        Pass everything that changes what a block's bytes mean, and nothing else: e.g. the
        plan's ``input_checksums`` entries ``layout`` and each group's ``groups[i].layers``
        and ``groups[i].spec``, the context fields that change a block's bytes
        (``dcp_size``, ``mamba_cache_mode``, ``max_encoder_tokens``; not ``num_blocks``, the
        budgets or ``max_model_len``: a replica with more memory stores the same bytes), the
        pool index, the tensor-parallel rank, and what names the weights. Refuses an empty
        namespace and values that are not str, bytes or int.
        """
        if not parts:
            raise ValueError(
                "BlockNamespace.of() needs at least one part (the plan's input checksums, "
                "the pool index, ...): an empty namespace would be shared by every model"
            )
        hasher = hashlib.blake2b(digest_size=NAMESPACE_DIGEST_SIZE, person=b"kvspec-remote-ns")
        for name in sorted(parts):
            value = parts[name]
            if isinstance(value, bool) or not isinstance(value, (str, bytes, int)):
                raise TypeError(
                    f"BlockNamespace.of(): part {name}={value!r} must be a str, bytes or int, "
                    f"not {type(value).__name__}"
                )
            if isinstance(value, str):
                tagged = _STR_TAG + _length_prefixed(value.encode("utf-8", "surrogatepass"))
            elif isinstance(value, bytes):
                tagged = _BYTES_TAG + _length_prefixed(bytes(value))
            else:
                tagged = _INT_TAG + _length_prefixed(str(int(value)).encode())
            hasher.update(_length_prefixed(name.encode("utf-8", "surrogatepass")) + tagged)
        return cls(hasher.digest())

    @classmethod
    def from_checksums(
        cls, checksums: Mapping[str, str], **parts: str | bytes | int
    ) -> BlockNamespace:
        """:meth:`of` the ``checksums`` (e.g. a plan's ``input_checksums`` minus what does not
        change a block's bytes) under ``checksum:<name>``, and ``parts`` beside them."""
        named: dict[str, str | bytes | int] = {f"checksum:{k}": v for k, v in checksums.items()}
        clash = named.keys() & parts.keys()
        if clash:
            raise ValueError(f"BlockNamespace.from_checksums(): parts {sorted(clash)} given twice")
        return cls.of(**named, **parts)

    def __post_init__(self) -> None:
        if not isinstance(self.digest, bytes) or len(self.digest) != NAMESPACE_DIGEST_SIZE:
            raise ValueError(
                f"BlockNamespace digest must be {NAMESPACE_DIGEST_SIZE} bytes; build it with "
                "BlockNamespace.of(...)"
            )

    def __str__(self) -> str:
        return self.digest.hex()


@dataclass(frozen=True)
class RemoteStoreConfig:
    """Where the server is and how long the engine may wait for it."""

    host: str = "127.0.0.1"
    port: int = 6379
    #: Database number (Redis' ``SELECT``).
    db: int = 0
    password: str | None = None
    #: Seconds to open a connection.
    connect_timeout_s: float = 0.05
    #: Seconds a call may take beyond connecting before the bytes it moves extend its
    #: deadline (see ``min_bytes_per_s``): what a silent server costs a small call.
    op_timeout_s: float = 0.2
    #: The slowest transfer a call tolerates, in bytes per second: each byte sent or
    #: received extends the call's deadline by ``1 / min_bytes_per_s`` seconds (a 4 MiB
    #: block adds about 0.4 s at the default 10 MB/s). A link slower than this loses the call.
    min_bytes_per_s: float = 10_000_000.0
    #: Failed calls in a row that open the circuit breaker.
    failures_to_open: int = 3
    #: Seconds the open breaker keeps calls from the server before one tries again.
    open_for_s: float = 1.0
    #: Expiry of stored blocks in seconds (None: the server's eviction policy decides).
    ttl_s: float | None = None
    #: Bytes of a block hash (the runtime's hashes are BLAKE2b-256).
    hash_size: int = DIGEST_SIZE

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "op_timeout_s", "open_for_s", "min_bytes_per_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"RemoteStoreConfig.{name}={value!r} must be a positive number")
        if self.ttl_s is not None and not (math.isfinite(self.ttl_s) and self.ttl_s >= 0.001):
            raise ValueError(f"RemoteStoreConfig.ttl_s={self.ttl_s!r} must be >= 0.001 or None")
        for name, low in (("failures_to_open", 1), ("hash_size", 1), ("port", 1), ("db", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RemoteStoreConfig.{name}={value!r} must be an int >= {low}")


@dataclass
class RemoteStoreCounters:
    """What a store's calls found (a snapshot: :attr:`RemoteBlockStore.counters`)."""

    #: Blocks ``get_many`` returned.
    hits: int = 0
    #: Blocks ``get_many`` did not return (absent, corrupt, or the call failed or was skipped).
    misses: int = 0
    #: Of the misses: values present but refused (header, length or digest wrong).
    corrupt: int = 0
    #: Blocks ``put_many`` stored.
    stored: int = 0
    #: Calls that failed on a server or connection error (timeouts not included).
    errors: int = 0
    #: Calls that ran into a timeout.
    timeouts: int = 0
    #: Calls the open breaker kept from the server.
    skipped: int = 0
    #: Times the breaker opened.
    breaker_opened: int = 0
    #: Value bytes received and sent (headers included).
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class _Breaker:
    """Closed until ``failures_to_open`` failures in a row; then open for ``open_for_s``,
    after which one call tries (half open): success closes it, failure opens it again."""

    failures_to_open: int
    open_for_s: float
    clock: Callable[[], float]
    failures_in_a_row: int = 0
    open_until: float | None = None

    def allows(self) -> bool:
        return self.open_until is None or self.clock() >= self.open_until

    def succeeded(self) -> None:
        self.failures_in_a_row = 0
        self.open_until = None

    def failed(self) -> bool:
        """Count a failure; True if the breaker opens now."""
        self.failures_in_a_row += 1
        half_open = self.open_until is not None
        if half_open or self.failures_in_a_row >= self.failures_to_open:
            self.open_until = self.clock() + self.open_for_s
            return True
        return False

    @property
    def is_open(self) -> bool:
        return self.open_until is not None and self.clock() < self.open_until


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the remote block store needs the redis client: pip install 'kvspec-core[remote]'"
        ) from error
    return redis


class RemoteBlockStore:
    """Blocks of one namespace on a Redis/Valkey server; see the module's documentation.

    ``clock`` (seconds, monotonic) is the breaker's; tests pass their own.
    """

    def __init__(
        self,
        namespace: BlockNamespace,
        config: RemoteStoreConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(namespace, BlockNamespace):
            raise TypeError(
                f"RemoteBlockStore: namespace must be a BlockNamespace (BlockNamespace.of(...)), "
                f"not {type(namespace).__name__}"
            )
        self.namespace = namespace
        self.config = config if config is not None else RemoteStoreConfig()
        redis_module = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        cfg = self.config
        self._deadline = _CallDeadline(
            cfg.connect_timeout_s + cfg.op_timeout_s, cfg.min_bytes_per_s, cfg.op_timeout_s
        )
        # No retries: a retry would multiply the time the engine waits; the breaker and the
        # next call are the retry. RESP2: no HELLO, which a Redis before 6 refuses.
        pool = redis_module.ConnectionPool(
            connection_class=_deadline_connection_class(redis_module),
            call_deadline=self._deadline,
            host=cfg.host,
            port=cfg.port,
            db=cfg.db,
            password=cfg.password,
            socket_connect_timeout=cfg.connect_timeout_s,
            # No per-read timeout: the call's deadline bounds every read and write.
            socket_timeout=None,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            protocol=2,
        )
        self._client: redis.Redis = redis_module.Redis(connection_pool=pool)
        self._errors: tuple[type[BaseException], ...] = (redis_module.RedisError, OSError)
        self._timeout_errors: tuple[type[BaseException], ...] = (
            redis_module.TimeoutError,
            TimeoutError,
        )
        self._key_prefix = KEY_PREFIX + namespace.digest
        self._ttl_ms = None if cfg.ttl_s is None else max(1, round(cfg.ttl_s * 1000))
        self._counters = RemoteStoreCounters()
        self._breaker = _Breaker(cfg.failures_to_open, cfg.open_for_s, clock)
        self._answered = False

    # -- public API ---------------------------------------------------------------------------

    @property
    def counters(self) -> RemoteStoreCounters:
        """A copy of the counters so far."""
        return RemoteStoreCounters(**vars(self._counters))

    @property
    def last_call_answered(self) -> bool:
        """Whether the last call reached the server and read its whole answer (False: it
        failed, timed out or the breaker kept it from the server, so its misses say nothing
        about what the server holds)."""
        return self._answered

    @property
    def breaker_open(self) -> bool:
        """True while the breaker keeps calls from the server."""
        return self._breaker.is_open

    def key_of(self, block_hash: bytes) -> bytes:
        """The server key of ``block_hash`` in this store's namespace."""
        return self._key_prefix + self._checked_hash(block_hash, "key_of", 0)

    def put_many(self, blocks: Iterable[tuple[bytes, bytes | bytearray | memoryview]]) -> int:
        """Store each ``(block hash, page bytes)`` (pipelined, one round trip); return how many
        the server took (0 when it is down, slow or the breaker is open)."""
        keyed = [
            (self._key_prefix + self._checked_hash(block_hash, "put_many", index), payload)
            for index, (block_hash, payload) in enumerate(blocks)
        ]
        values = [
            _encode_value(key, _checked_payload(payload, index))
            for index, (key, payload) in enumerate(keyed)
        ]
        if not values:
            self._answered = True  # nothing to ask
            return 0
        if not self._breaker_allows():
            return 0

        def run(pipe: Any) -> list[Any]:
            for (key, _), value in zip(keyed, values, strict=True):
                pipe.set(key, value, px=self._ttl_ms)
            return pipe.execute(raise_on_error=False)

        replies = self._pipelined(run)
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

    def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        """Each block's page bytes, or None where the server has none, has a corrupt one, is
        down or slow, or the breaker is open (one pipelined MGET)."""
        keys = [
            self._key_prefix + self._checked_hash(block_hash, "get_many", index)
            for index, block_hash in enumerate(block_hashes)
        ]
        if not keys:
            self._answered = True
            return []
        if not self._breaker_allows():
            self._counters.misses += len(keys)
            return [None] * len(keys)
        values = self._pipelined(lambda pipe: pipe.mget(keys).execute()[0])
        if values is None or len(values) != len(keys):
            self._answered = False
            self._counters.misses += len(keys)
            return [None] * len(keys)
        found: list[bytes | None] = []
        for key, value in zip(keys, values, strict=True):
            payload = None
            if value is not None:
                self._counters.bytes_in += len(value)
                payload = _decode_value(key, value)
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
        if not self._breaker_allows():
            return [False] * len(keys)

        def run(pipe: Any) -> list[Any]:
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        replies = self._pipelined(run)
        if replies is None or len(replies) != len(keys):
            self._answered = False
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
        """Close the connections (the store can still be used: it reconnects)."""
        with contextlib.suppress(*self._errors):
            self._client.close()

    # -- internals ----------------------------------------------------------------------------

    def _checked_hash(self, block_hash: object, method: str, index: int) -> bytes:
        if not isinstance(block_hash, bytes) or len(block_hash) != self.config.hash_size:
            raise TypeError(
                f"RemoteBlockStore.{method}: block hash [{index}] must be {self.config.hash_size} "
                f"bytes (a PrefixHasher hash), not {type(block_hash).__name__}"
                + (f" of {len(block_hash)} bytes" if isinstance(block_hash, bytes) else "")
            )
        return block_hash

    def _breaker_allows(self) -> bool:
        self._answered = False
        if self._breaker.allows():
            return True
        self._counters.skipped += 1
        return False

    def _pipelined(self, run: Callable[[Any], Any]) -> Any:
        """``run(pipeline)``'s result within the call's deadline, or None if it failed
        (counted; the breaker told; the connections dropped, as one may hold half an
        answer). Whatever the client raises is a failure: the caller's input was checked
        before; only an interrupt (a BaseException that is not an Exception) propagates."""
        self._deadline.start()
        try:
            result = run(self._client.pipeline(transaction=False))
        except self._timeout_errors:
            self._counters.timeouts += 1
            self._dropped()
            return None
        except Exception:
            self._counters.errors += 1
            self._dropped()
            return None
        except BaseException:
            self._disconnect()
            raise
        finally:
            self._deadline.stop()
        self._breaker.succeeded()
        self._answered = True
        return result

    def _dropped(self) -> None:
        self._disconnect()
        if self._breaker.failed():
            self._counters.breaker_opened += 1

    def _disconnect(self) -> None:
        with contextlib.suppress(Exception):
            self._client.connection_pool.disconnect()


class _CallDeadline:
    """The deadline of the store call in progress, shared by its connections' sockets:
    ``base_s`` after the call starts, plus ``1 / min_bytes_per_s`` per byte moved since."""

    def __init__(self, base_s: float, min_bytes_per_s: float, idle_timeout_s: float) -> None:
        self._base_s = base_s
        self._idle_timeout_s = idle_timeout_s
        self._seconds_per_byte = 1.0 / min_bytes_per_s
        self._until: float | None = None

    def start(self) -> None:
        self._until = time.monotonic() + self._base_s

    def stop(self) -> None:
        self._until = None

    def credit(self, num_bytes: int) -> None:
        if self._until is not None:
            self._until += num_bytes * self._seconds_per_byte

    def bounded(self, timeout: float | None) -> float | None:
        """``timeout`` (a socket timeout the client asked for, None: none) cut to the time
        left; raises ``TimeoutError`` once the deadline has passed. No call in progress (a
        close): ``timeout``, or ``idle_timeout_s`` for none."""
        if self._until is None:
            return self._idle_timeout_s if timeout is None else timeout
        left = self._until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the remote store call's deadline passed")
        return left if timeout is None else min(timeout, left)


class _DeadlineSocket:
    """A connected socket whose reads and writes end by the call's deadline: before each,
    the socket's timeout is the one the client asked for, cut to the time left. Everything
    else is the socket's."""

    def __init__(self, sock: socket.socket, deadline: _CallDeadline) -> None:
        self._sock = sock
        self._deadline = deadline
        self._asked = sock.gettimeout()

    def settimeout(self, timeout: float | None) -> None:
        self._asked = timeout
        self._sock.settimeout(timeout)

    def gettimeout(self) -> float | None:
        return self._asked

    def recv(self, size: int, *flags: int) -> bytes:
        self._sock.settimeout(self._deadline.bounded(self._asked))
        data = self._sock.recv(size, *flags)
        self._deadline.credit(len(data))
        return data

    def recv_into(self, buffer: Any, *args: int) -> int:
        self._sock.settimeout(self._deadline.bounded(self._asked))
        received = self._sock.recv_into(buffer, *args)
        self._deadline.credit(received)
        return received

    def sendall(self, data: Any, *flags: int) -> None:
        # sendall's timeout bounds the whole send: credit its bytes first.
        self._deadline.credit(memoryview(data).nbytes)
        self._sock.settimeout(self._deadline.bounded(None))
        try:
            self._sock.sendall(data, *flags)
        finally:
            self._sock.settimeout(self._asked)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _deadline_connection_class(redis_module: Any) -> type:
    """redis-py's TCP connection whose socket keeps the store's call deadline (a subclass
    made here: redis is imported only when a store is built)."""

    class DeadlineConnection(redis_module.Connection):
        def __init__(self, *, call_deadline: _CallDeadline, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._call_deadline = call_deadline

        def _connect(self) -> Any:
            return _DeadlineSocket(super()._connect(), self._call_deadline)

    return DeadlineConnection


def _checked_payload(payload: object, index: int) -> bytes | bytearray | memoryview:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"RemoteBlockStore.put_many: block [{index}]'s pages must be bytes, bytearray or "
            f"memoryview, not {type(payload).__name__}"
        )
    return payload


def _digest(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    hasher = hashlib.blake2b(digest_size=32, person=b"kvspec-remote-v")
    hasher.update(_length_prefixed(key))
    hasher.update(payload)
    return hasher.digest()


def _encode_value(key: bytes, payload: bytes | bytearray | memoryview) -> bytes:
    """The stored value of ``payload`` under ``key``: header then payload."""
    view = memoryview(payload).cast("B")
    header = _HEADER.pack(_MAGIC, VALUE_FORMAT_VERSION, 0, view.nbytes, _digest(key, view))
    return header + view.tobytes()


def _decode_value(key: bytes, value: bytes) -> bytes | None:
    """The payload of ``value`` read under ``key``, or None unless header, length and digest
    all match."""
    if len(value) < HEADER_SIZE:
        return None
    magic, version, reserved, length, digest = _HEADER.unpack_from(value)
    if magic != _MAGIC or version != VALUE_FORMAT_VERSION or reserved != 0:
        return None
    if length != len(value) - HEADER_SIZE:
        return None
    payload = value[HEADER_SIZE:]
    if not hmac.compare_digest(_digest(key, payload), digest):
        return None
    return payload
