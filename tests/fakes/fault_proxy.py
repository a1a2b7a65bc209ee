"""A TCP proxy in front of a local server that injects the faults object storage really shows.

Contract: `FaultProxy(target_host, target_port, host="127.0.0.1")` listens on `host:port` (a free
port) and forwards every connection to the target, until `fault(kind, seconds)` turns on one of:
- "503": every new connection is answered `HTTP/1.1 503 Service Unavailable` (after its request
  head is read) and closed, as an overloaded S3 front end does;
- "timeout": new connections are accepted and never answered (the client's own timeout fires);
- "reset": new connections are closed at once with a TCP reset.
for `seconds` (None: until `heal()`). Connections that were being forwarded when a fault starts are
cut too (an outage drops them). Bounded: every thread ends at `close()`; it only ever binds `host`
(loopback or a test's own namespace address) and connects to the target it was given.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

KINDS = ("503", "timeout", "reset")


class FaultProxy:
    def __init__(self, target_host: str, target_port: int, *, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((host, 0))
        self._lsock.listen(64)
        self.host, self.port = host, self._lsock.getsockname()[1]
        self._kind: str | None = None
        self._until = 0.0
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.faulted_connections = 0  # connections that met a fault (a test checks the fault was hit)
        self._thread = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def fault(self, kind: str, seconds: float | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; one of {KINDS}")
        with self._lock:
            self._kind, self._until = kind, (time.monotonic() + seconds if seconds is not None else float("inf"))
            for s in list(self._open):  # an outage also drops what was in flight
                self._drop(s)

    def heal(self) -> None:
        with self._lock:
            self._kind = None

    def current(self) -> str | None:
        with self._lock:
            if self._kind is not None and time.monotonic() >= self._until:
                self._kind = None
            return self._kind

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._lsock.close()
        with self._lock:
            for s in list(self._open):
                self._drop(s)
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------------
    def _drop(self, s: socket.socket) -> None:
        self._open.discard(s)
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with contextlib.suppress(OSError):
            s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                r, _, _ = select.select([self._lsock], [], [], 0.2)
                if not r:
                    continue
                conn, _ = self._lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        kind = self.current()
        if kind is not None:
            with self._lock:
                self.faulted_connections += 1
        if kind == "reset":
            with self._lock:
                self._drop(conn)
            return
        if kind == "503":
            self._answer_503(conn)
            return
        if kind == "timeout":
            with self._lock:
                self._open.add(conn)
            # held open until the test changes the fault or closes the proxy (the events this stands for)
            while self.current() == "timeout" and conn in self._open and not self._closed.wait(0.1):
                pass
            with self._lock:
                self._drop(conn)
            return
        self._forward(conn)

    def _answer_503(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        with contextlib.suppress(OSError):
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 65536:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                head += chunk
            body = b"<Error><Code>SlowDown</Code><Message>injected 503</Message></Error>"
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                         b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        with contextlib.suppress(OSError):
            conn.close()

    def _forward(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(self.target, timeout=5)
        except OSError:
            with contextlib.suppress(OSError):
                conn.close()
            return
        up.settimeout(None)
        with self._lock:
            self._open.update((conn, up))
        try:
            socks = [conn, up]
            while not self._closed.is_set() and conn in self._open and up in self._open:
                r, _, _ = select.select(socks, [], [], 0.2)
                for s in r:
                    data = s.recv(65536)
                    if not data:
                        return
                    (up if s is conn else conn).sendall(data)
        except OSError:
            return
        finally:
            with self._lock:
                self._drop(conn)
                self._drop(up)
