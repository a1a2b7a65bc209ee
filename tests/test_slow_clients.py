"""The control server times out slow clients (issue 44, item 14).

A client that connected and sent nothing, or a byte at a time, held one of the controller's threads
for ever. Now a request must arrive whole within the server's client timeout (30 s; 1 s here): the
connection is then cut. Real clients are unaffected: a long poll may wait longer than that (the
request had arrived), and a kept-alive connection the server closed while idle is reopened at once.
Traffic stays on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from sailor_core.runtime.protocol import SECRET_HEADER, ControlClient, ControlServer
from tests.waits import hold_for


def _closed_within(sock: socket.socket, limit_s: float) -> float:
    """Seconds until the server closed `sock` (reads return b''); fails after `limit_s`."""
    sock.settimeout(limit_s)
    t0 = time.monotonic()
    try:
        while sock.recv(1024):
            pass
    except TimeoutError:
        raise AssertionError(f"the server kept a silent client's connection open for {limit_s} s") from None
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def test_a_client_that_sends_nothing_is_cut_off():
    server = ControlServer(client_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            assert _closed_within(s, 10.0) < 5.0
    finally:
        server.close()


def test_a_client_that_trickles_its_request_is_cut_off_before_it_ends():
    server = ControlServer(client_timeout_s=1.0)
    request = f"GET /kv/x HTTP/1.1\r\nHost: a\r\n{SECRET_HEADER}: {server.secret}\r\n\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            cut = threading.Event()

            def trickle() -> None:
                for b in request:  # one byte every 0.2 s: 13 s for the whole request
                    try:
                        s.send(bytes([b]))
                    except OSError:
                        cut.set()
                        return
                    if cut.wait(0.2):  # the pace of a slow client, until the server cuts it off
                        return

            t = threading.Thread(target=trickle, daemon=True)
            t.start()
            assert _closed_within(s, 10.0) < 5.0
            # the server may have reset the connection (bytes of the request unread), leaving nothing to shut down
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            t.join(timeout=15)
    finally:
        server.close()


def test_a_body_larger_than_the_limit_is_refused_unread():
    server = ControlServer(client_timeout_s=1.0)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(f"PUT /kv/x HTTP/1.1\r\nHost: a\r\n{SECRET_HEADER}: {server.secret}\r\n"
                      f"Content-Length: {1 << 40}\r\n\r\n".encode())
            s.settimeout(10)
            status_line = s.recv(1024).split(b"\r\n")[0]
            assert b" 413 " in status_line, status_line
        assert server.get("x") is None
    finally:
        server.close()


def test_real_clients_long_polls_and_kept_alive_connections_still_work():
    server = ControlServer(client_timeout_s=1.0)
    client = ControlClient(server.endpoint, server.secret, timeout_s=5.0, retry_s=5.0)
    try:
        threading.Timer(2.5, server.set, args=("late", "v")).start()
        t0 = time.monotonic()
        assert client.get("late", wait_s=10.0) == "v"  # waited 2.5 s, past the 1 s client timeout
        assert time.monotonic() - t0 >= 2.0
        hold_for(2.0, "the kept-alive connection idling past the timeout (the server closes it)")
        client.set("k", "1")  # and the client reopens it at once
        assert server.get("k") == "1"
        client.append("l", "a")
        assert client.read_list("l") == ["a"]
    finally:
        server.close()
