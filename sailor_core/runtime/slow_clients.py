"""HTTP requests that must arrive in bounded time: the control server's defence against slow clients.

Contract: `BoundedRequests` is a `BaseHTTPRequestHandler` whose every request must arrive whole (its
request line, headers and body) within `request_read_s` of the handler starting to wait for it, and
whose socket waits at most `timeout` for any one read or write. A client that connects and sends
nothing, or trickles a byte at a time, loses its connection (a thread per connection, each held for
ever, was the price of a slow client before); a client that keeps its connection alive between
requests simply reconnects (`ControlClient` retries a closed kept-alive connection at once). A body
larger than `max_body_bytes` is refused (413) unread. The body is read before the request is
handled, into `self.body`: a handler that then waits (a long poll) holds no read deadline.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler

CLIENT_IDLE_S = 30.0  # one read or write, and a kept-alive connection's wait for its next request
REQUEST_READ_S = 30.0  # a whole request, from the wait for its first byte to its last
MAX_BODY_BYTES = 64 << 20  # a plan or an assignment is a few MB at most


class BoundedRequests(BaseHTTPRequestHandler):
    timeout = CLIENT_IDLE_S  # StreamRequestHandler puts it on the socket
    request_read_s = REQUEST_READ_S
    max_body_bytes = MAX_BODY_BYTES
    body = b""

    def handle_one_request(self) -> None:
        watch = threading.Timer(self.request_read_s, self._cut)
        watch.daemon = True
        self._watch = watch
        watch.start()
        try:
            super().handle_one_request()
        finally:
            watch.cancel()

    def _cut(self) -> None:
        """The request did not arrive in time: end the connection (the blocked read returns at once)."""
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def parse_request(self) -> bool:
        if not super().parse_request():
            self._watch.cancel()
            return False
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if not 0 <= n <= self.max_body_bytes:
            self._watch.cancel()
            self.send_error(413 if n > 0 else 400, "refused: body size")
            return False
        self.body = self.rfile.read(n) if n else b""
        self._watch.cancel()  # arrived: what the handler does next (a long poll) is not a slow client
        return len(self.body) == n
