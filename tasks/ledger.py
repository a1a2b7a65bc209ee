"""What a run's VMs cost: each VM from when it was rented until it was released, at its hourly price.

Contract (no Prefect, no I/O): `Ledger(clock=...)` records `rent(vms)` and `release(vm_ids)` (a VM
released twice keeps its first end; an unknown id is ignored) and answers `usd_so_far()` (every VM,
open ones up to now), `usd_per_hour_now()` (the VMs still rented) and `len(ledger)` (VMs ever rented).
The clock is passed in, so a test needs no sleeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from infra.provider import Vm


@dataclass(kw_only=True)
class Rental:
    usd_per_hour: float
    start: float
    end: float | None = None  # None: still rented


class Ledger:
    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._rentals: dict[str, Rental] = {}

    def rent(self, vms: Iterable[Vm]) -> None:
        now = self._clock()
        for v in vms:
            self._rentals[v.vm_id] = Rental(usd_per_hour=v.usd_per_hour, start=now)

    def release(self, vm_ids: Iterable[str]) -> None:
        now = self._clock()
        for v in vm_ids:
            r = self._rentals.get(v)
            if r is not None and r.end is None:
                r.end = now

    def release_all(self) -> None:
        self.release(list(self._rentals))

    def usd_so_far(self) -> float:
        now = self._clock()
        return sum(r.usd_per_hour * ((now if r.end is None else r.end) - r.start) / 3600.0
                   for r in self._rentals.values())

    def usd_per_hour_now(self) -> float:
        return sum(r.usd_per_hour for r in self._rentals.values() if r.end is None)

    def __len__(self) -> int:
        return len(self._rentals)
