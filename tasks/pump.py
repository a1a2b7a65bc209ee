"""Keeps a local provider's view of the run current while the flow is busy elsewhere.

Contract (no Prefect here): `ProviderPump(provider, run_id, controller, board).start()` runs a thread
that, every `period_s` until `stop()`, lets the provider look at the run (`provider.events`): its
scripted events fire when their step or time comes, a preemption notice's grace ends on time, and a
VM that stopped beating is found lost; the heartbeats it judges by come from the controller
(`HeartbeatBoard.follow`). When the newest generation's rank 0 holds at a scripted step
(`Controller.held`, sailor_core/runtime/protocol.py), the pump shows the provider that step first
and then releases the workers, so the event happens exactly at its step even while the flow
re-plans or waits on the Prefect API. The flow's monitor reports the events it finds logged as before.

A pump never ends the run: a provider error is counted and logged once, and the next tick tries again.
"""

from __future__ import annotations

import logging
import threading

from infra.provider import Provider
from tasks.control import Controller, HeartbeatBoard

PUMP_PERIOD_S = 0.25


class ProviderPump:
    def __init__(self, provider: Provider, run_id: str, controller: Controller, board: HeartbeatBoard, *,
                 period_s: float = PUMP_PERIOD_S, log: logging.Logger | logging.LoggerAdapter | None = None) -> None:
        self.provider, self.run_id, self.controller, self.board = provider, run_id, controller, board
        self.period_s = period_s
        self.log = log or logging.getLogger("sailor")
        self.errors = 0
        self.released: list[int] = []  # the steps released so far (tests and the run's record)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"pump-{run_id}", daemon=True)

    def start(self) -> ProviderPump:
        self.board.follow(self.controller)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def tick(self) -> None:
        """One look: the held step shown to the provider, its events fired, the workers released."""
        held = self.controller.held()
        if held is not None:
            for vm in self.controller.generation_vms:
                self.board.beat(vm, step=held[1])
        try:
            self.provider.events(self.run_id)
        finally:  # a provider that failed to look must not keep the workers waiting
            if held is not None:
                self.controller.release(*held)
                self.released.append(held[1])

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.tick()
            except Exception as e:  # noqa: BLE001 - the monitor sees the same provider and decides; retry next tick
                self.errors += 1
                if self.errors == 1:
                    self.log.warning("looking at the provider between the flow's polls failed: %s", e)
