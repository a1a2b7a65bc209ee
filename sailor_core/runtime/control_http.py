"""The control server's HTTP side (sailor_core/runtime/protocol.py states the protocol): the board of
string keys and append-only lists that the server's request threads share, and the request handler.

Contract: `handler(board, secret, client_timeout_s)` is the request handler class `QuietServer` serves:
every request must carry the run's secret in the `SECRET_HEADER` header (else 403, nothing read or
written) and arrive whole within `client_timeout_s` (`slow_clients.py`); GET/PUT /kv/<key> read and
set a key (a GET may wait for it: ?wait=S), GET/POST /list/<key> read (?start=N) and append. A key's
set time is kept by this machine's clock (`Board.received`).
"""

from __future__ import annotations

import hmac
import json
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sailor_core.runtime.slow_clients import BoundedRequests

SECRET_HEADER = "X-Sailor-Secret"
LISTEN_BACKLOG = 1024  # pending connections the control server queues (a generation's start is a burst)


class Board:
    """The server's keys and lists, shared by its request threads (a read may wait for a key)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.kv: dict[str, str] = {}
        self.lists: dict[str, list[str]] = {}
        self.received: dict[str, float] = {}  # when each key was last set, by this machine's clock

    def set(self, key: str, value: str) -> None:
        with self.cond:
            self.kv[key] = value
            self.received[key] = time.time()
            self.cond.notify_all()

    def get(self, key: str, wait_s: float = 0.0) -> str | None:
        deadline = time.monotonic() + wait_s
        with self.cond:
            while key not in self.kv:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(left)
            return self.kv[key]

    def append(self, key: str, line: str) -> None:
        with self.cond:
            self.lists.setdefault(key, []).append(line)

    def read(self, key: str, start: int = 0) -> list[str]:
        with self.cond:
            return list(self.lists.get(key, [])[start:])


def handler(board: Board, secret: str, client_timeout_s: float) -> type[BaseHTTPRequestHandler]:
    class Handler(BoundedRequests):  # a request arrives whole within client_timeout_s, or its client is cut off
        protocol_version = "HTTP/1.1"
        timeout = request_read_s = client_timeout_s

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
            pass

        def _authorised(self) -> bool:
            given = self.headers.get(SECRET_HEADER, "")
            if hmac.compare_digest(given.encode(), secret.encode()):
                return True
            self._reply(403, b"refused: missing or wrong run secret")
            self.close_connection = True
            return False

        def _reply(self, code: int, body: bytes = b"") -> None:
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> str:
            return self.body.decode()  # read with the request, within its deadline (slow_clients.py)

        def _route(self) -> tuple[str, str, dict[str, list[str]]]:
            u = urllib.parse.urlsplit(self.path)
            kind, _, key = u.path.lstrip("/").partition("/")
            return kind, urllib.parse.unquote(key), urllib.parse.parse_qs(u.query)

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            if not self._authorised():
                return
            kind, key, q = self._route()
            if kind == "kv":
                value = board.get(key, float(q.get("wait", ["0"])[0]))
                if value is None:
                    self._reply(404)
                else:
                    self._reply(200, value.encode())
            elif kind == "list":
                self._reply(200, json.dumps(board.read(key, int(q.get("start", ["0"])[0]))).encode())
            else:
                self._reply(404)

        def _write(self, to: str, write: Callable[[str, str], None]) -> None:
            """The request's body written by `write(key, body)` under /<to>/<key> (404 elsewhere)."""
            if not self._authorised():
                return
            kind, key, _ = self._route()
            body = self._body()
            if kind != to:
                return self._reply(404)
            write(key, body)
            self._reply(204)

        def do_PUT(self) -> None:  # noqa: N802
            self._write("kv", board.set)

        def do_POST(self) -> None:  # noqa: N802
            self._write("list", board.append)

    return Handler


class QuietServer(ThreadingHTTPServer):
    # Hundreds of workers connect at once when a generation starts: with the stdlib's backlog of 5 a
    # burst of 64 ranks had its connections reset. The kernel caps this at net.core.somaxconn.
    request_queue_size = LISTEN_BACKLOG

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a worker killed mid-request (preempted, stopped) is routine, not an error to print
