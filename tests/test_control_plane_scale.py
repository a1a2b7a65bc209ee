"""The controller serves hundreds of workers at once, and its clients ride out a short absence.

A 64-rank `sailor train` failed because the control server listened with a backlog of 5 and opened a
connection per request: a burst of 256 clients got `Connection reset by peer` on most requests.
"""

from __future__ import annotations

import socket
import threading
import time

from sailor_core.runtime.protocol import ControlClient, ControlServer
from tests.waits import hold_for


def _burst(server: ControlServer, clients: int, rounds: int) -> list[str]:
    errors: list[str] = []
    go = threading.Event()

    def one(i: int) -> None:
        c = ControlClient(server.endpoint, server.secret, timeout_s=30)
        go.wait()
        for k in range(rounds):
            try:
                c.set(f"hb/{i}", str(k))
                c.append("metrics/v1", f'{{"step": {k}, "from": {i}}}')
                assert c.get(f"hb/{i}") == str(k)
            except Exception as e:  # noqa: BLE001 - counted: the test asserts there are none
                errors.append(f"{type(e).__name__}: {e}"[:200])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(timeout=300)
    return errors


def test_256_clients_at_once_get_every_answer():
    server = ControlServer()
    try:
        errors = _burst(server, clients=256, rounds=5)
        assert errors == [], f"{len(errors)} failed requests, e.g. {errors[:3]}"
        assert len(server.read_list("metrics/v1")) == 256 * 5
    finally:
        server.close()


def test_a_client_keeps_its_connection_between_requests():
    server = ControlServer()
    try:
        c = ControlClient(server.endpoint, server.secret)
        c.set("k", "v")
        first = c.connection_count
        for _ in range(20):
            c.get("k")
        assert c.connection_count == first == 1  # one kept-alive connection, not one per request
    finally:
        server.close()


def test_a_client_retries_while_the_controller_is_briefly_unreachable():
    # A port nothing listens on yet; the server starts there 1 s later: the request gets through.
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    holder: list[ControlServer] = []

    def start_later() -> None:
        hold_for(1.0, "the controller's outage: nothing listens on its port")
        holder.append(ControlServer(port=port, secret="s" * 32))

    t = threading.Thread(target=start_later)
    t.start()
    try:
        c = ControlClient(f"127.0.0.1:{port}", "s" * 32, retry_s=20)
        c.set("k", "v")
        assert c.get("k") == "v"
    finally:
        t.join()
        for s in holder:
            s.close()


def test_a_client_gives_up_after_its_retry_deadline():
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    c = ControlClient(f"127.0.0.1:{port}", "s" * 32, retry_s=1.0)
    t0 = time.monotonic()
    try:
        c.set("k", "v")
    except Exception as e:  # noqa: BLE001 - checked below
        assert "unreachable" in str(e) and "retried" in str(e)
    else:
        raise AssertionError("a controller that never answers must fail the request")
    assert 0.9 < time.monotonic() - t0 < 10


def test_a_kept_connection_the_server_closed_is_replaced_at_once():
    # The server cuts off a client idle past its timeout; the client's next request goes through on a new one.
    import select

    server = ControlServer(client_timeout_s=0.5)
    try:
        c = ControlClient(server.endpoint, server.secret, retry_s=0.5)
        c.set("k", "v")
        sock = c._local.conn.sock
        deadline = time.monotonic() + 10
        while not select.select([sock], [], [], 0.1)[0]:  # readable: the server closed its end (EOF)
            assert time.monotonic() < deadline, "the server kept an idle connection past its timeout"
        assert c.get("k") == "v" and c.connection_count == 2
    finally:
        server.close()
