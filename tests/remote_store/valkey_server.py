"""A real Valkey server on loopback for the remote block store's tests (scripts/remote-store-env
fetches the binary into .cache/remote-store/; KVSPEC_REMOTE_STORE_SERVER names another)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Why the tests that need a server are skipped when there is none.
NO_SERVER = (
    "no valkey-server: run scripts/remote-store-env (scripts/dev-setup does) or set "
    "KVSPEC_REMOTE_STORE_SERVER to a redis-server/valkey-server binary"
)


def server_binary() -> Path | None:
    """The server binary to run, or None if there is none."""
    named = os.environ.get("KVSPEC_REMOTE_STORE_SERVER")
    if named:
        return Path(named)
    found = sorted(REPO.glob(".cache/remote-store/valkey-*/valkey-server"))
    return found[-1] if found else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def answers_ping(port: int, timeout_s: float = 0.2) -> bool:
    """True if a server on 127.0.0.1:port answers PING (raw protocol: no client needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class ServerProcess:
    """One server process on 127.0.0.1:``port``, no persistence (nothing written to disk)."""

    def __init__(self, binary: Path, port: int, workdir: Path) -> None:
        self.binary, self.port, self.workdir = binary, port, workdir
        self.log = workdir / f"valkey-{port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> None:
        """Start it and wait until it answers PING (raises with the server's log if not)."""
        command = [
            str(self.binary),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--loglevel", "warning",
        ]  # fmt: skip
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"valkey-server on port {self.port} did not come up:\n"
                    + self.log.read_text(errors="replace")[-2000:]
                )
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL: the server dies as a crashed machine would, its data with it."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def pause(self) -> None:
        """SIGSTOP: the server hangs (connections are still accepted by the kernel)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop it whatever state it is in (paused included)."""
        if self.process is None:
            return
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process = None


@contextlib.contextmanager
def running_server(workdir: Path) -> Iterator[ServerProcess]:
    """A server on 127.0.0.1 on a free port, no persistence, stopped on exit (also when the
    body fails). The caller skips when :func:`server_binary` finds none."""
    binary = server_binary()
    assert binary is not None
    for attempt in range(3):
        server = ServerProcess(binary, free_port(), workdir)
        try:
            server.start()
            break
        except RuntimeError:
            if attempt == 2:  # not a port another process took meanwhile: say why
                raise
    try:
        yield server
    finally:
        server.stop()
