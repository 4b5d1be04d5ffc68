"""The total deadline of a remote store call (``remote_server.py``), kept by the sockets of the
server's connections: a call ends, as a timeout, at the latest ``base_s`` after it starts plus
``1 / min_bytes_per_s`` per byte it has sent and received since (a server that stops
answering or trickles its answer is cut there; a large block on a fast link goes through).
A call may also bound the bytes it receives (what it asked for can be no longer): a server
that sends more, however fast, fails the call there (:class:`ReplyTooLong`) instead of
holding it and filling the client's memory.
"""

from __future__ import annotations

import socket
import time
from typing import Any


class ReplyTooLong(ConnectionError):
    """The server sent a call more bytes than its answer can hold."""


class CallDeadline:
    """The deadline of the call in progress on one server, shared by its connections'
    sockets: ``base_s`` after the call starts, plus ``1 / min_bytes_per_s`` per byte moved
    since."""

    def __init__(self, base_s: float, min_bytes_per_s: float, idle_timeout_s: float) -> None:
        self._base_s = base_s
        self._idle_timeout_s = idle_timeout_s
        self._seconds_per_byte = 1.0 / min_bytes_per_s
        self._until: float | None = None
        self._received = 0
        self._max_received: int | None = None

    def start(self, max_received: int | None = None) -> None:
        """A call starts; it may receive at most ``max_received`` bytes (None: no bound)."""
        self._until = time.monotonic() + self._base_s
        self._received = 0
        self._max_received = max_received

    def stop(self) -> None:
        self._until = None
        self._max_received = None

    def credit(self, num_bytes: int) -> None:
        if self._until is not None:
            self._until += num_bytes * self._seconds_per_byte

    def received(self, num_bytes: int) -> None:
        """``num_bytes`` arrived: credited, and counted against the call's bound."""
        self.credit(num_bytes)
        if self._until is None or self._max_received is None:
            return
        self._received += num_bytes
        if self._received > self._max_received:
            raise ReplyTooLong(
                f"the remote store sent over {self._max_received} bytes, more than the "
                "call's answer can hold"
            )

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


class DeadlineSocket:
    """A connected socket whose reads and writes end by the call's deadline: before each,
    the socket's timeout is the one the client asked for, cut to the time left. Everything
    else is the socket's."""

    def __init__(self, sock: socket.socket, deadline: CallDeadline) -> None:
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
        self._deadline.received(len(data))
        return data

    def recv_into(self, buffer: Any, *args: int) -> int:
        self._sock.settimeout(self._deadline.bounded(self._asked))
        received = self._sock.recv_into(buffer, *args)
        self._deadline.received(received)
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


def deadline_connection_class(redis_module: Any) -> type:
    """redis-py's TCP connection whose socket keeps the server's call deadline (a subclass
    made here: redis is imported only when a server is built)."""

    class DeadlineConnection(redis_module.Connection):
        def __init__(self, *, call_deadline: CallDeadline, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self._call_deadline = call_deadline

        def _connect(self) -> Any:
            return DeadlineSocket(super()._connect(), self._call_deadline)

    return DeadlineConnection
