"""The worker control protocol, defined once: controller <-> agent <-> worker.

Every side uses this module: `sailor train`'s launcher (sailor_core/runtime/launcher.py), the flow's
controller (tasks/control.py), the per-VM agent (sailor_core/runtime/agent.py, `sailor worker`) and
the worker process (sailor_core/runtime/worker_proc.py).

Transport: the controller runs a small HTTP server (`ControlServer`; its board and request handler are
in control_http.py) holding string keys and append-only lists. It binds the one address its workers
reach it at (loopback on one machine, the testbed bridge or the VM network elsewhere), never every
interface, and refuses (HTTP 403, nothing read or written) every request that does not carry the run's
secret in the `X-Sailor-Secret` header. Workers read the secret from `SAILOR_RUN_SECRET`; it never
appears on a command line. A request must arrive whole within 30 s (`slow_clients.py`): a client that
sends nothing, or a byte at a time, is cut off instead of holding a thread for ever.

    PUT  /kv/<key>                 set a value
    GET  /kv/<key>?wait=S          the value; waits up to S seconds for it to appear (404 if not)
    POST /list/<key>               append one line
    GET  /list/<key>?start=N       lines N.. as a JSON array

Keys (one generation g per plan version the workers are handed; a worker id is
`<vm id>/<local index>` in the flow and `<n>` under `sailor train`):

    g<g>/assign/<worker>   the worker's `Assignment` for generation g (JSON)
    g<g>/status/<worker>   done | stopped | switched | failed: <reason>
    g<g>/abort             set when a member of generation g is lost: blocked waits wake up
    g<g>/stop              end generation g at the next step, checkpointed; its workers go on to g+1
                           keeping their state in memory (status `switched`)
    g<g>/loaded/<worker>   how the worker resumed in generation g: memory | checkpoint | none
    g<g>/rdv               host:port of the generation's process-group store (hosted by its rank 0)
    g<g>/held              the step rank 0 holds at: a step of the assignment's `hold_at_steps` (a
                           scripted event's step); every rank waits there until
    g<g>/release/<step>    is set (by the flow, once its provider has seen the step), or HOLD_MAX_S
    hb/<worker>            the worker's latest heartbeat {"time", "step"} (JSON)
    hb/vm/<vm id>          the agent's heartbeat {"time", "workers": {id: pid}} (JSON)
    metrics/v<version>     list: one JSON record per training step, from rank 0

Rank 0 also appends each step's record to its own file `metrics-v<version>.jsonl` in
$SAILOR_METRICS_DIR when that is set (the agent sets it to the VM's folder and uploads the file with
the logs): the record survives a lost request to the controller.

An assignment's `rank` is the worker's global rank; `IDLE` (-2) keeps the process waiting for the next
generation (a VM with more devices than its replica needs) and `EXIT` (-1) ends it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from typing import Any

from sailor_core.errors import ProtocolError as ProtocolError  # re-exported for callers
from sailor_core.runtime.control_http import SECRET_HEADER, Board, QuietServer, handler
from sailor_core.runtime.slow_clients import CLIENT_IDLE_S

SECRET_ENV = "SAILOR_RUN_SECRET"
EXIT = -1
IDLE = -2
HEARTBEAT_S = 2.0
HOLD_MAX_S = 10.0  # the longest rank 0 holds at a step unreleased (well within a collective's timeout)
RETRY_S = 20.0  # how long a client retries an unreachable controller before it gives up (the flow's
# default heartbeat timeout: a worker that cannot reach the controller for longer counts as lost anyway)


def new_secret() -> str:
    return secrets.token_hex(16)


def assign_key(gen: int, worker: str) -> str:
    return f"g{gen}/assign/{worker}"


def status_key(gen: int, worker: str) -> str:
    return f"g{gen}/status/{worker}"


def abort_key(gen: int) -> str:
    return f"g{gen}/abort"


def stop_key(gen: int) -> str:
    """Set by the controller to end generation g at the next step boundary, with a checkpoint, so its
    workers go on to g+1 with their state in memory (a plan change without restarts)."""
    return f"g{gen}/stop"


def loaded_key(gen: int, worker: str) -> str:
    """How the worker resumed in generation g: memory, checkpoint or none."""
    return f"g{gen}/loaded/{worker}"


def rendezvous_key(gen: int) -> str:
    return f"g{gen}/rdv"


def held_key(gen: int) -> str:
    """Set by rank 0 to the step it holds at (an `Assignment.hold_at_steps` step)."""
    return f"g{gen}/held"


def release_key(gen: int, step: int) -> str:
    """Set by the controller's side to let generation g go on past a held step."""
    return f"g{gen}/release/{step}"


def heartbeat_key(worker: str) -> str:
    return f"hb/{worker}"


def vm_heartbeat_key(vm_id: str) -> str:
    return f"hb/vm/{vm_id}"


def metrics_key(version: int) -> str:
    return f"metrics/v{version}"


def worker_id(vm_id: str, local_index: int) -> str:
    return f"{vm_id}/{local_index}"


def vm_of(worker: str) -> str:
    """The VM of a worker id made by `worker_id`."""
    return worker.rsplit("/", 1)[0]


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """What one worker process runs in one generation."""

    rank: int
    world_size: int = 0
    plan: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    resume: bool = False
    local_rank: int = 0
    # steps after which rank 0 holds the generation until released (release_key): a scripted event's
    # step, so the event happens at that step however fast the job trains (see the keys above)
    hold_at_steps: tuple[int, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Assignment:
        d = json.loads(raw)
        return cls(rank=int(d["rank"]), world_size=int(d.get("world_size", 0)), plan=d.get("plan") or {},
                   settings=d.get("settings") or {}, resume=bool(d.get("resume")),
                   local_rank=int(d.get("local_rank", 0)),
                   hold_at_steps=tuple(int(x) for x in d.get("hold_at_steps") or ()))


class ControlServer:
    """The controller's side: binds `host` only; in-process reads and writes skip HTTP."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, secret: str | None = None,
                 client_timeout_s: float = CLIENT_IDLE_S) -> None:
        self.secret = secret or new_secret()
        self._board = Board()
        self._http = QuietServer((host, port), handler(self._board, self.secret, client_timeout_s))
        self._http.daemon_threads = True
        self.host = host
        self.port = int(self._http.server_address[1])
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="sailor-control", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def set(self, key: str, value: str) -> None:
        self._board.set(key, value)

    def get(self, key: str, wait_s: float = 0.0) -> str | None:
        return self._board.get(key, wait_s)

    def read_list(self, key: str, start: int = 0) -> list[str]:
        return self._board.read(key, start)

    def received_at(self, key: str) -> float | None:
        """When `key` was last set, by the controller's clock (None: never)."""
        with self._board.cond:
            return self._board.received.get(key)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort: a server already closed has nothing to release
            self._http.shutdown()
            self._http.server_close()


class ControlClient:
    """A worker's or agent's side. Safe to share between threads: each thread keeps one connection
    alive across its requests (HTTP/1.1 keep-alive), so a job's workers hold a few connections each
    instead of opening one per request. A request that cannot reach the controller (refused, reset,
    timed out) is retried with exponential backoff for up to `retry_s`, on a fresh connection, before
    `ProtocolError` says the controller is unreachable: a restarting or overloaded controller costs a
    delay, not a rank. A retried append may arrive twice (readers key step records by step)."""

    def __init__(self, endpoint: str, secret: str, *, timeout_s: float = 30.0, retry_s: float = RETRY_S) -> None:
        host, _, port = endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise ProtocolError(f"control endpoint {endpoint!r} is not HOST:PORT")
        self.host, self.port, self.secret, self.timeout_s = host, int(port), secret, timeout_s
        self.retry_s = retry_s
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self.connection_count = 0  # connections opened so far (one per thread while the controller stays up)

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
            self._local.conn = conn
            with self._count_lock:
                self.connection_count += 1
        conn.timeout = timeout_s
        if conn.sock is not None:
            conn.sock.settimeout(timeout_s)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def _once(self, method: str, path: str, data: bytes | None, timeout_s: float) -> tuple[int, bytes]:
        conn = self._connection(timeout_s)
        try:
            conn.request(method, path, body=data, headers={SECRET_HEADER: self.secret,
                                                           "Content-Length": str(len(data or b""))})
            resp = conn.getresponse()
            payload = resp.read()
        except BaseException:
            self._drop()
            raise
        if resp.will_close:
            self._drop()
        return resp.status, payload

    def _request(
        self, method: str, path: str, body: str | None = None, timeout_s: float | None = None
    ) -> tuple[int, bytes]:
        data = body.encode() if body is not None else None
        deadline = time.monotonic() + self.retry_s
        delay, tries = 0.05, 0
        while True:
            tries += 1
            reused = getattr(self._local, "conn", None) is not None
            try:
                status, payload = self._once(method, path, data, timeout_s or self.timeout_s)
                break
            except (OSError, http.client.HTTPException) as e:
                if reused and tries == 1 and isinstance(e, ConnectionResetError | BrokenPipeError):
                    continue  # a kept-alive connection the server had closed: once more on a fresh one, at once
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProtocolError(f"controller {self.host}:{self.port} unreachable: {e} (retried {tries} "
                                        f"time(s) over {self.retry_s:.0f}s)") from e
                time.sleep(min(delay, left))
                delay = min(delay * 2, 2.0)
        if status == 403:
            raise ProtocolError(f"controller {self.host}:{self.port} refused the request: {payload.decode()[:200]}")
        return status, payload

    def set(self, key: str, value: str) -> None:
        self._request("PUT", "/kv/" + urllib.parse.quote(key, safe="/"), value)

    def get(self, key: str, wait_s: float = 0.0) -> str | None:
        q = f"?wait={wait_s:g}" if wait_s > 0 else ""
        status, payload = self._request("GET", "/kv/" + urllib.parse.quote(key, safe="/") + q,
                                        timeout_s=wait_s + self.timeout_s)
        return payload.decode() if status == 200 else None

    def wait(self, key: str, timeout_s: float) -> str:
        """The key's value, waiting in long polls of at most 30 s; ProtocolError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            value = self.get(key, wait_s=max(0.0, min(30.0, left)))
            if value is not None:
                return value
            if left <= 0:
                raise ProtocolError(f"no {key} from the controller within {timeout_s:.0f}s")

    def check(self, key: str) -> bool:
        return self.get(key) is not None

    def append(self, key: str, line: str) -> None:
        self._request("POST", "/list/" + urllib.parse.quote(key, safe="/"), line)

    def read_list(self, key: str, start: int = 0) -> list[str]:
        _, payload = self._request("GET", "/list/" + urllib.parse.quote(key, safe="/") + f"?start={start}")
        return list(json.loads(payload or b"[]"))


def assign_generation(board: Any, gen: int, *, plan: dict[str, Any], settings: dict[str, Any],
                      resume: bool, vms: list[tuple[str, int, tuple[int, ...]]],
                      hold_at_steps: tuple[int, ...] = ()) -> list[str]:
    """Hand out generation `gen`: `vms` lists (vm id, devices, global ranks it runs) in rank order.

    Worker i of a VM runs the VM's i-th rank with local rank i (device i); its other workers sit the
    generation out. Returns the member worker ids in rank order.
    """
    world = sum(len(ranks) for _, _, ranks in vms)
    members: list[tuple[int, str]] = []
    for vm_id, devices, ranks in vms:
        if len(ranks) > devices:
            raise ValueError(f"VM {vm_id} has {devices} device(s) but was given ranks {list(ranks)}")
        for i in range(devices):
            wid = worker_id(vm_id, i)
            if i < len(ranks):
                a = Assignment(rank=ranks[i], world_size=world, plan=plan, settings=settings, resume=resume,
                               local_rank=i, hold_at_steps=hold_at_steps)
                members.append((ranks[i], wid))
            else:
                a = Assignment(rank=IDLE)
            board.set(assign_key(gen, wid), a.to_json())
    return [w for _, w in sorted(members)]


def client_from_env(timeout_s: float = 30.0) -> ControlClient:
    """The run's controller as a VM's process sees it: $SAILOR_CONTROL and $SAILOR_RUN_SECRET."""

    endpoint, secret = os.environ.get("SAILOR_CONTROL", ""), os.environ.get(SECRET_ENV, "")
    if not endpoint or not secret:
        raise ProtocolError(f"no controller: set SAILOR_CONTROL (HOST:PORT) and ${SECRET_ENV}")
    return ControlClient(endpoint, secret, timeout_s=timeout_s)


def job_key(vm_id: str, job: int) -> str:
    """Where a VM reports the exit status of a one-off command (e.g. profiling) it was given."""
    return f"jobs/{vm_id}/{job}"


if __name__ == "__main__":  # `python -m sailor_core.runtime.protocol set KEY VALUE`, for the VM bootstrap
    import sys

    if len(sys.argv) != 4 or sys.argv[1] != "set":
        sys.exit("usage: python -m sailor_core.runtime.protocol set KEY VALUE")
    client_from_env().set(sys.argv[2], sys.argv[3])
