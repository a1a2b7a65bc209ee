"""Who takes part in each outer step of a semi-synchronous run (runtime/islands.py's membership).

Contract: `Quorum(store)` reads and writes the run's island store (a torch `Store`; islands.host_store
hosts it), under `outer/`:
    `outer/islands`          JSON list of the run's island ids (set once by whoever hosts the store)
    `outer/away/<i>`         "1" while island i is away (reconfiguring, done, or dropped after a timeout)
    `outer/decided`          the last outer step v whose members were decided (it never goes back)
    `outer/v<v>/join/<i>`    island i's leader at its boundary: {"tokens", "version", "incarnation"}
    `outer/v<v>/members`     {"members": [...], "info": {i: join}}: set once (compare-and-set) by the
                             first leader that sees every island not away joined, or QUORUM_S after
                             its own join (the missing ones are then marked away)
`members(v, island, join)`: the island's leader joins outer step v and returns its members; an island
not among them (it came too late) joins v + 1. `wait_members(v)`: the island's other ranks read the
decision. Torch only for the store; no process group.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from sailor_core.errors import PeerLost

QUORUM_S = 120.0  # how long an island waits at a boundary for islands that are not away
POLL_S = 0.02


def _get(store: Any, key: str) -> str | None:
    """The value of `key`, or None when it is not set (never blocks)."""
    if not store.check([key]):
        return None
    return bytes(store.get(key)).decode()


class Quorum:
    """Outer-step membership over a shared store (see the module's contract)."""

    def __init__(self, store: Any, *, quorum_s: float = QUORUM_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.store, self.quorum_s, self.clock, self.sleep = store, quorum_s, clock, sleep

    def islands(self) -> list[int]:
        raw = _get(self.store, "outer/islands")
        return json.loads(raw) if raw else []

    def decided(self) -> int:
        raw = _get(self.store, "outer/decided")
        return int(raw) if raw else 0

    def set_away(self, island: int, away: bool) -> None:
        if away:
            self.store.set(f"outer/away/{island}", "1")
        elif _get(self.store, f"outer/away/{island}") is not None:
            self.store.delete_key(f"outer/away/{island}")

    def away(self) -> set[int]:
        return {i for i in self.islands() if _get(self.store, f"outer/away/{i}") == "1"}

    def members(self, v: int, island: int, join: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Join outer step v (or the first one after it still open) as `island`; (the step, its decision)."""
        while True:
            self.store.set(f"outer/v{v}/join/{island}", json.dumps(join))
            self.set_away(island, False)
            decision = self._decide(v)
            if island in decision["members"]:
                return v, decision
            v += 1  # decided without us (we came late): the next outer step

    def _decide(self, v: int) -> dict[str, Any]:
        key = f"outer/v{v}/members"
        start = self.clock()
        while True:
            raw = _get(self.store, key)
            if raw is not None:
                return dict(json.loads(raw))
            everyone = self.islands()
            joined = {i: json.loads(j) for i in everyone if (j := _get(self.store, f"outer/v{v}/join/{i}"))}
            late = self.clock() - start > self.quorum_s
            if joined and (set(everyone) - self.away() <= set(joined) or late):
                for i in set(everyone) - set(joined):
                    if late:
                        self.set_away(i, True)
                value = json.dumps({"members": sorted(joined), "info": {str(i): j for i, j in joined.items()}})
                self.store.compare_set(key, "", value)
                self._advance_decided(v)
                continue  # read back whoever won
            self.sleep(POLL_S)

    def _advance_decided(self, v: int) -> None:
        """`outer/decided` becomes v unless it is there already or beyond (it never goes back)."""
        while True:
            cur = _get(self.store, "outer/decided") or ""
            if cur and int(cur) >= v:
                return
            if bytes(self.store.compare_set("outer/decided", cur, str(v))).decode() == str(v):
                return

    def wait_members(self, v: int, timeout_s: float) -> dict[str, Any]:
        """The decision of outer step v (for the ranks of an island other than its leader)."""
        deadline = self.clock() + timeout_s
        while (raw := _get(self.store, f"outer/v{v}/members")) is None:
            if self.clock() > deadline:
                raise PeerLost(f"outer step {v}: no decision on its members within {timeout_s:.0f} s; to fix: "
                               f"check that every island's leader reaches the store")
            self.sleep(POLL_S)
        return dict(json.loads(raw))
