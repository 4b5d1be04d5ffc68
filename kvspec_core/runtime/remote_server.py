"""One Redis/Valkey server as the remote block stores see it (``remote_store.py``): where it is,
the connections to it, the deadline of each call, and what the engine has learned of its
health (the circuit breaker).

Every store built on one :class:`RemoteServer` shares all of that, so a hybrid model's
per-group stores learn once that the server is down: with the server gone, the first
``failures_to_open`` failed calls *of all of them together* open the breaker, which then
keeps every one of them from the server for ``open_for_s`` seconds; the next call of any of
them tries again and, if the server answers, closes it for all. A store built on a
:class:`RemoteStoreConfig` gets a server of its own.

A server's stores are used by one thread at a time (an engine's scheduler): they share the
call deadline and the connections. Each process makes its own.
"""

from __future__ import annotations

import contextlib
import enum
import ipaddress
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvspec_core.runtime.hashing import DIGEST_SIZE
from kvspec_core.runtime.remote_breaker import Breaker
from kvspec_core.runtime.remote_deadline import CallDeadline, deadline_connection_class

if TYPE_CHECKING:
    import redis


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
    #: Failed calls in a row (of all the stores on one server) that open the circuit breaker.
    failures_to_open: int = 3
    #: Seconds the open breaker keeps calls from the server before one tries again.
    open_for_s: float = 1.0
    #: Expiry of stored blocks in seconds (None: the server's eviction policy decides).
    ttl_s: float | None = None
    #: Bytes of a block hash (the runtime's hashes are BLAKE2b-256: a ``RemoteTier``
    #: refuses a store of another size).
    hash_size: int = DIGEST_SIZE

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "op_timeout_s", "open_for_s", "min_bytes_per_s"):
            value = getattr(self, name)
            if not _is_real(value) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"RemoteStoreConfig.{name}={value!r} must be a positive number")
        ttl = self.ttl_s
        if ttl is not None and not (_is_real(ttl) and math.isfinite(ttl) and ttl >= 0.001):
            raise ValueError(
                f"RemoteStoreConfig.ttl_s={ttl!r} must be a number >= 0.001 (seconds) or None"
            )
        for name, low in (("failures_to_open", 1), ("hash_size", 1), ("port", 1), ("db", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RemoteStoreConfig.{name}={value!r} must be an int >= {low}")
        if self.port > 65535:
            raise ValueError(f"RemoteStoreConfig.port={self.port!r} must be at most 65535")
        _check_host(self.host)
        if self.password is not None and not isinstance(self.password, str):
            raise ValueError(
                f"RemoteStoreConfig.password must be a str or None, not "
                f"{type(self.password).__name__}"
            )


def _is_real(value: object) -> bool:
    """A real number, not a bool (``True`` would pass as 1 second)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_host(host: object) -> None:
    """``host`` is a name or an address; a colon is allowed only in an IPv6 address (the
    client would read "10.0.0.5:6379" as a name and fail every call as a miss)."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"RemoteStoreConfig.host={host!r} must be a non-empty str")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(
                f"RemoteStoreConfig.host={host!r} must be a name or an address without a "
                "port: give the port as port=..."
            ) from None


@dataclass
class RemoteServerCounters:
    """What the calls of all the stores on one server met (a snapshot:
    :attr:`RemoteServer.counters`); each store counts its own calls too
    (``RemoteStoreCounters``)."""

    #: Calls the breaker let through to the server.
    calls: int = 0
    #: Of those, calls that failed (a server or connection error, a malformed answer, a
    #: timeout): each told the breaker. A write the server refused is an answer, not one.
    failed: int = 0
    #: Of the failed calls, those that ran into a timeout.
    timeouts: int = 0
    #: Calls the open breaker kept from the server.
    skipped: int = 0
    #: Times the breaker opened.
    breaker_opened: int = 0


class CallStatus(enum.Enum):
    """How a call to the server ended (:class:`CallOutcome`)."""

    ANSWERED = "answered"
    #: The open breaker kept it from the server.
    SKIPPED = "skipped"
    TIMED_OUT = "timed out"
    #: A server or connection error, or any other failure inside the client.
    FAILED = "failed"


@dataclass(frozen=True)
class CallOutcome:
    """A call's end: its status, the answer (None unless answered), and whether this call
    opened the breaker."""

    status: CallStatus
    answer: Any = None
    opened_breaker: bool = False


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the remote block store needs the redis client: pip install 'kvspec-core[remote]'"
        ) from error
    return redis


class RemoteServer:
    """The connections to one Redis/Valkey server, its call deadline and its breaker, shared
    by every :class:`~kvspec_core.runtime.remote_store.RemoteBlockStore` built on it (see the
    module docstring). ``clock`` (seconds, monotonic) is the breaker's; tests pass their own.
    """

    def __init__(
        self,
        config: RemoteStoreConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if config is not None and not isinstance(config, RemoteStoreConfig):
            raise TypeError(
                f"RemoteServer: config must be a RemoteStoreConfig, not {type(config).__name__}"
            )
        self.config = cfg = config if config is not None else RemoteStoreConfig()
        redis_module = _import_redis()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self._deadline = CallDeadline(
            cfg.connect_timeout_s + cfg.op_timeout_s, cfg.min_bytes_per_s, cfg.op_timeout_s
        )
        # No retries: a retry would multiply the time the engine waits; the breaker and the
        # next call are the retry. RESP2: no HELLO, which a Redis before 6 refuses.
        pool = redis_module.ConnectionPool(
            connection_class=deadline_connection_class(redis_module),
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
        self._breaker = Breaker(cfg.failures_to_open, cfg.open_for_s, clock)
        self._counters = RemoteServerCounters()

    @property
    def counters(self) -> RemoteServerCounters:
        """A copy of the counters so far (all the stores on this server)."""
        return RemoteServerCounters(**vars(self._counters))

    @property
    def breaker_open(self) -> bool:
        """True while the breaker keeps calls from the server."""
        return self._breaker.is_open

    def pipelined(
        self, run: Callable[[Any], Any], max_reply_bytes: int | None = None
    ) -> CallOutcome:
        """``run(pipeline)``'s answer within the call's deadline, unless the breaker keeps
        the call from the server or the call fails (counted; the breaker told; the
        connections dropped, as one may hold half an answer). A server that sends more
        than ``max_reply_bytes`` (None: no bound) fails the call there. Whatever the
        client raises is a failure: the caller's input was checked before; only an
        interrupt (a BaseException that is not an Exception) propagates."""
        counters = self._counters
        if not self._breaker.allows():
            counters.skipped += 1
            return CallOutcome(CallStatus.SKIPPED)
        counters.calls += 1
        self._deadline.start(max_reply_bytes)
        try:
            answer = run(self._client.pipeline(transaction=False))
        except self._timeout_errors:
            counters.timeouts += 1
            return self._failed(CallStatus.TIMED_OUT)
        except Exception:
            return self._failed(CallStatus.FAILED)
        except BaseException:
            self._disconnect()
            raise
        finally:
            self._deadline.stop()
        self._breaker.succeeded()
        return CallOutcome(CallStatus.ANSWERED, answer)

    def close(self) -> None:
        """Close the connections (every store on the server can still be used: it
        reconnects)."""
        with contextlib.suppress(*self._errors):
            self._client.close()

    def _failed(self, status: CallStatus) -> CallOutcome:
        self._counters.failed += 1
        self._disconnect()
        opened = self._breaker.failed()
        self._counters.breaker_opened += opened
        return CallOutcome(status, opened_breaker=opened)

    def _disconnect(self) -> None:
        with contextlib.suppress(Exception):
            self._client.connection_pool.disconnect()
