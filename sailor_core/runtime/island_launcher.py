"""Run an island plan on this machine: one local job per island, meeting in a store this process hosts.

Contract: `run_islands(ip, cfg, settings, run_dir=...)` hosts the islands' store on loopback
(`islands.host_store`), then runs every island of `ip` at once, each as `launcher.run_local` runs a
plan (its own control server, workers and generations), with `settings` made the island's: its
`islands` settings (its id, the outer loop, the store, its share of each global batch), its own
checkpoint folder (`<checkpoint_uri>/island<i>`) and metrics file (`<metrics_out>.island<i>`), and
`on_event` told which island spoke (`island` key). It returns each island's `RunResult` in island
order, or raises the first island's error once every island has ended (an island that fails is
marked away by its ranks: the others go on). Threads, not processes: run_local's work is in its
worker processes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sailor_core.models.config import TransformerConfig
from sailor_core.runtime.engine import TrainSettings
from sailor_core.runtime.islands import IslandSettings, host_store
from sailor_core.runtime.launcher import RunResult, run_local
from sailor_core.semisync import IslandPlan


def island_settings(ip: IslandPlan, i: int, settings: TrainSettings, store: str) -> TrainSettings:
    """`settings` for island i of `ip`, its store at "host:port"."""
    isl = IslandSettings(island=i, sync=ip.sync, store=store, global_batch_size=ip.global_batch_size,
                         batch_offset=ip.batch_offset(i))
    uri = settings.checkpoint_uri
    return replace(settings, islands=isl.to_dict(), checkpoint_uri=f"{uri.rstrip('/')}/island{i}" if uri else None,
                   metrics_out=f"{settings.metrics_out}.island{i}" if settings.metrics_out else None)


def run_islands(ip: IslandPlan, cfg: TransformerConfig, settings: TrainSettings, *, run_dir: str,
                on_event: Callable[[dict[str, Any]], None] | None = None) -> list[RunResult]:
    """Every island of `ip` at once on this machine (see the module's contract)."""
    store, address = host_store("127.0.0.1", list(range(len(ip.islands))), timeout_s=settings.timeout_s)
    results: list[RunResult | None] = [None] * len(ip.islands)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        told = (lambda ev: on_event({**ev, "island": i})) if on_event is not None else None
        try:
            results[i] = run_local(ip.islands[i], cfg, island_settings(ip, i, settings, address), on_event=told,
                                   run_dir=os.path.join(run_dir, f"island{i}"))
        except BaseException as e:  # noqa: BLE001 - raised below, once every island has ended
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), name=f"island-{i}") for i in range(len(ip.islands))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    del store  # the islands are done with it
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]
