"""Tiny servers on loopback that speak enough of the Redis protocol to misbehave on purpose
(an answer trickled byte by byte, a slow reader, a malformed answer, a server without
``HELLO``): the scenarios a real server cannot be made to play. Each connection is served
by ``handler(connection, reader)`` in a thread of its own; stopped with the context."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator


class CommandReader:
    """The commands a client sends (RESP arrays of bulk strings), read ``chunk`` bytes per
    ``recv`` with ``pause_s`` after each (a slow reader when both are small)."""

    def __init__(self, connection: socket.socket, chunk: int = 65536, pause_s: float = 0.0):
        self._connection = connection
        self._chunk = chunk
        self._pause_s = pause_s
        self._buffer = bytearray()

    def _fill(self) -> None:
        data = self._connection.recv(self._chunk)
        if not data:
            raise ConnectionError("the client closed the connection")
        self._buffer += data
        if self._pause_s:
            time.sleep(self._pause_s)

    def _line(self) -> bytes:
        while (end := self._buffer.find(b"\r\n")) < 0:
            self._fill()
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 2]
        return line

    def _exactly(self, size: int) -> bytes:
        while len(self._buffer) < size + 2:
            self._fill()
        data = bytes(self._buffer[:size])
        del self._buffer[: size + 2]
        return data

    def command(self) -> list[bytes]:
        count = int(self._line()[1:])
        return [self._exactly(int(self._line()[1:])) for _ in range(count)]


Handler = Callable[[socket.socket, CommandReader], None]


@contextlib.contextmanager
def misbehaving_server(
    handler: Handler, *, chunk: int = 65536, pause_s: float = 0.0
) -> Iterator[int]:
    """A server on 127.0.0.1 serving each connection with ``handler`` (its reader reads
    ``chunk`` bytes at a time, pausing ``pause_s`` after each); yields its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stopped = threading.Event()

    def serve(connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            handler(connection, CommandReader(connection, chunk, pause_s))

    def accept() -> None:
        while not stopped.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(connection,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        stopped.set()
        listener.close()


def answer_simply(command: list[bytes]) -> bytes:
    """A well-formed answer: EXISTS -> 1, MGET -> nils, HELLO -> a RESP3 map, anything else
    -> +OK."""
    name = command[0].upper()
    if name == b"HELLO":
        return b"%1\r\n+proto\r\n:3\r\n"
    if name == b"EXISTS":
        return b":1\r\n"
    if name == b"MGET":
        return b"*%d\r\n" % (len(command) - 1) + b"$-1\r\n" * (len(command) - 1)
    return b"+OK\r\n"
