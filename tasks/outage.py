"""The Prefect server as something the run can lose: training goes on while it is away, and stops cleanly
if it does not come back.

Contract (no Prefect import here): `PrefectWatch(health_url, outage_s=...)` probes the server's
`/health` every `probe_s` from a thread (`start`, `stop`). `state()` is `up`, `down` (no answer since
`down_since`, for less than `outage_s`) or `lost` (no answer for `outage_s`). The flow's monitor
(tasks/steps.py) reads it at each poll: while the server is down it makes no Prefect call (no artifact,
no task state: each would block on the client's retries, about a minute) and does not return, so the
workers train on and the heartbeats the provider judges them by keep coming (tasks/pump.py); when the
server answers again the monitor goes on as before. When it is lost, the monitor calls `on_lost`, which
stops the job without Prefect (flows/sailor.py: the VMs' agents stopped, so the workers checkpoint; the
outcome written to the run history; one line on stderr; exit 1): a Prefect call in that state would
only block.

Before, `kill -9` of the demo's server stalled the flow in the client's retries; the provider saw no
heartbeat for 81 s, called all 4 healthy VMs lost, removed them, and the command ended 9 minutes later
with 4 tracebacks.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable

DEFAULT_OUTAGE_S = 30.0  # no answer for this long: the server is lost (the run stops within about a minute)
PROBE_S = 2.0  # how often the server's health is asked
PROBE_TIMEOUT_S = 2.0


class PrefectWatch:
    def __init__(self, health_url: str, *, outage_s: float = DEFAULT_OUTAGE_S, probe_s: float = PROBE_S,
                 clock: Callable[[], float] = time.monotonic,
                 probe: Callable[[str], bool] | None = None) -> None:
        self.health_url, self.outage_s, self.probe_s = health_url, outage_s, probe_s
        self.clock = clock
        self.probe = probe or _answers
        self.down_since: float | None = None  # by `clock`; None while it answers
        self.outages = 0  # how many times it stopped answering
        self.on_lost: Callable[[str], None] | None = None  # set by the flow: stop the job without Prefect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="prefect-watch", daemon=True)

    def start(self) -> PrefectWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def look(self) -> None:
        """One probe: the server answered, or since when it has not."""
        if self.probe(self.health_url):
            self.down_since = None
        elif self.down_since is None:
            self.down_since = self.clock()
            self.outages += 1

    def state(self) -> str:
        if self.down_since is None:
            return "up"
        return "lost" if self.clock() - self.down_since >= self.outage_s else "down"

    def why(self) -> str:
        """The outage in the user's words."""
        away = 0.0 if self.down_since is None else self.clock() - self.down_since
        return f"the Prefect server ({self.health_url.removesuffix('/health')}) has not answered for {away:.0f} s"

    def _loop(self) -> None:
        while not self._stop.wait(self.probe_s):
            self.look()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as r:
            return bool(200 <= r.status < 300)
    except OSError:
        return False
