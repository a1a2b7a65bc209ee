"""Planner at scale (issue 43): search time, objective and proven gap on a ladder of pools from 1 zone x 1 GPU
type x 64 GPUs to 20 zones x 5 types x 4,096 GPUs, and a monotonicity sweep over random (pool, larger pool)
pairs, on a profile store this bench generates (links by zone, region and continent, prices per type, two
types with partial links).

The store (a temporary folder, or --store DIR to keep it), written through profiles_store's public API and
read back as `sailor plan --store` reads it (`open_store(uri).profile_book(model)`):
- OPT-350's model and layer profiles for A100-40, V100-16, GH-96, A100-80 and Titan-RTX, and each type's
  intra-node links, copied from the shipped seed;
- 20 zones in 7 regions on 3 continents (us-central1-a/b/c/f, us-west1-b/a, us-east1-b/c/d, europe-west4-a/b/c,
  europe-west1-b/c/d, asia-east1-a/b/c, asia-northeast1-a/b);
- a network link between every two (zone, GPU type) ends, one fit per class of the zone pair: same zone,
  same region, same continent (the seed's measured A100-40 fits us-central1-a -> us-central1-a, -> us-central1-b,
  -> us-west1-b) and across continents (the same-continent fit at OCEAN_BANDWIDTH_FACTOR of its bandwidth, plus
  OCEAN_EXTRA_LATENCY_S per message: an assumption, not a measurement), each scaled by the slower end's NIC
  (its same-zone seed bandwidth over A100-40's); GPU counts 1, 2, 4 (and 8 between two 8-GPU nodes);
- partial links (PARTIAL): GH-96 reaches the other types only inside each region's first zone and other GH-96
  across zones only to or from such a zone (as in the seed); A100-80 has no link across continents;
- egress by GCP's published classes (0 in a zone, 0.01 USD/GB across zones, 0.02 across regions of a
  continent, 0.05 inside Asia and between North America and Europe, 0.08 to or from Asia);
- on-demand prices: the seed's (A100-40, V100-16, GH-96) or GCP's list price (A100-80: a2-ultragpu-1g) or an
  assumed rental price (Titan-RTX, which no cloud lists), times a per-region factor; spot at SPOT_FACTOR of it.

Ladder: OPT-350, global batch 1024, max throughput (two min-cost rungs); the large rungs with
`SearchOptions(max_search_s=10)`, the others with no budget. Per pool: zones, types, GPUs, search time (wall
and CPU), the objective (it/s or USD/iteration), the gap the planner proves (`PlanResult.stats.gap`: 0 optimal
over the searched space, None unknown) and the ratio of the wall time to its target (5 zones x 3 types x ~1,000
GPUs: 1 s; 20 x 5 x 4,096: 10 s). Each search runs in a forked child killed after --kill-after seconds (120; a
budget's triple plus 30 s), so a planner that does not stop cannot hang the bench.

Sweep: --pairs random (pool, larger pool) pairs of a few zones and up to ~256 GPUs (seeded: --seed), the larger
one adding GPUs to an entry, a zone, a GPU type or a market (a spot copy of an entry, with a price); same
objective and limits (a quarter min-cost; some with a limit at 30-80 % of what the smaller pool's fastest plan
costs per hour or runs); and, without --quick, a few larger pairs (the issue's 4-zone pool plus GH-96, 5 zones
x 3 types and others). Searches without a budget; a killed or failed search is printed with its pools. A
violation: the larger pool's chosen plan worse on the objective than the smaller pool's by more than the
planner's tolerance (`SearchOptions().tolerance`). Each violation is printed with both pools and both plans.

The output goes to stdout and to --out (default out/bench_planner_scale.txt). The last line:
`pools=N slowest_s=X violations=V worst_gap_pct=Y`: N every pool planned (ladder and sweep), X the slowest
ladder search (wall), V the sweep's violations, Y the ladder's largest proven gap in percent (`unknown` when a
rung's planner proves none). Exit status 1 when there is a violation, a search failed or was killed, or a
rung's CPU time exceeds its target.

Usage: .venv/bin/python bench/bench_planner_scale.py [--quick] [--pairs N] [--seed S] [--out FILE] [--store DIR]
       [--kill-after S]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from profiles_store import open_store  # noqa: E402
from profiles_store.store import SEED_DIR  # noqa: E402
from profiles_store.tables import (  # noqa: E402
    EGRESS_PRICES,
    GPU_PRICES,
    GPU_TYPES,
    INTRA_NODE_LINKS,
    LAYER_PROFILES,
    MODELS,
    NETWORK_LINKS,
)
from sailor_core.domain import BandwidthFit, EgressPrice, GpuPrice, Market, NetworkLink, Provenance  # noqa: E402
from sailor_core.planner import (  # noqa: E402
    Constraints,
    Objective,
    PlanRequest,
    PlanResult,
    SearchOptions,
    parse_pool,
    plan,
    summarize,
)
from sailor_core.profiles import ProfileBook  # noqa: E402

MODEL = "OPT-350"
GLOBAL_BATCH = 1024
OUT = REPO / "out" / "bench_planner_scale.txt"

# -- the world ------------------------------------------------------------------------------------

# In ladder order: the first 5 are the 5-zone pool, the first 9 North America, 15 two continents.
ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-b",
         "us-east1-b", "us-east1-c", "us-east1-d", "us-west1-a",
         "europe-west4-a", "europe-west4-b", "europe-west4-c", "europe-west1-b", "europe-west1-c", "europe-west1-d",
         "asia-east1-a", "asia-east1-b", "asia-east1-c", "asia-northeast1-a", "asia-northeast1-b")
CONTINENT = {"us": "north-america", "europe": "europe", "asia": "asia"}  # by the zone name's first word
TYPES = ("A100-40", "V100-16", "GH-96", "A100-80", "Titan-RTX")  # ladder order
PARTIAL = {
    "GH-96": "links to other types only inside each region's first zone, to GH-96 across zones only to or from "
             "such a zone (as the seed has them)",
    "A100-80": "no links across continents",
}
# Link classes: the seed's measured A100-40 fits between these zones; "ocean" is derived from "continent".
REFERENCE_GPU = "A100-40"
SEED_CLASS_ZONES = {"zone": ("us-central1-a", "us-central1-a"), "region": ("us-central1-a", "us-central1-b"),
                    "continent": ("us-central1-a", "us-west1-b")}
OCEAN_BANDWIDTH_FACTOR = 0.5  # assumption: a flow over ~100 ms RTT gets about half the ~30 ms one's throughput
OCEAN_EXTRA_LATENCY_S = 0.035  # assumption: one-way ~50 ms across an ocean minus ~15 ms inside a continent
# GCP's published egress classes (premium tier), USD per GB.
EGRESS_USD_PER_GB = {"zone": 0.0, "region": 0.01, "continent": 0.02, "ocean": 0.05}
EGRESS_ASIA_USD_PER_GB = {"continent": 0.05, "ocean": 0.08}
# Prices: the seed's us-central1-a on-demand price where it has one, else these (USD per GPU-hour).
EXTRA_USD_PER_GPU_HOUR = {"A100-80": 5.06879,  # GCP a2-ultragpu-1g, us-central1, on demand
                          "Titan-RTX": 0.70}  # assumption: no cloud lists it; a consumer card's rental price
REGION_PRICE_FACTOR = {"us-central1": 1.0, "us-west1": 1.0, "us-east1": 1.0, "europe-west4": 1.10,
                       "europe-west1": 1.10, "asia-east1": 1.17, "asia-northeast1": 1.28}  # about GCP's list ratios
SPOT_FACTOR = 0.35  # GCP spot A100/V100 are about a third of on demand
RECORDED_AT = datetime(2026, 1, 1, tzinfo=UTC)  # fixed: the store is the same on every run
PROVENANCE = Provenance(source="bench_planner_scale", host="synthetic", recorded_at=RECORDED_AT,
                        settings="generated by bench/bench_planner_scale.py from the shipped seed")


def region_of(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def continent_of(zone: str) -> str:
    return CONTINENT[zone.split("-", 1)[0]]


def zone_class(a: str, b: str) -> str:
    """'zone', 'region', 'continent' or 'ocean': what separates two zones."""
    if a == b:
        return "zone"
    if region_of(a) == region_of(b):
        return "region"
    return "continent" if continent_of(a) == continent_of(b) else "ocean"


def egress_usd_per_gb(a: str, b: str) -> float:
    cls = zone_class(a, b)
    if "asia" in (continent_of(a), continent_of(b)) and cls in EGRESS_ASIA_USD_PER_GB:
        return EGRESS_ASIA_USD_PER_GB[cls]
    return EGRESS_USD_PER_GB[cls]


def anchors(zones: Sequence[str]) -> frozenset[str]:
    """Each region's first zone in `zones`: where a partially profiled type has its links."""
    first: dict[str, str] = {}
    for z in zones:
        first.setdefault(region_of(z), z)
    return frozenset(first.values())


def profiled(a: str, ga: str, b: str, gb: str, anchor: frozenset[str]) -> bool:
    """Whether the store has the link (a, ga) -> (b, gb) (PARTIAL says which it lacks)."""
    if "GH-96" in (ga, gb):
        if ga == gb:
            return a == b or a in anchor or b in anchor
        if not (a == b and a in anchor):
            return False
    return not ("A100-80" in (ga, gb) and continent_of(a) != continent_of(b))


def scaled(fit: BandwidthFit, factor: float, extra_latency_s: float = 0.0) -> BandwidthFit:
    """The fit with every bandwidth times `factor` (the quadratic's coefficients and the peak)."""
    a, b, c = fit.coeffs
    return BandwidthFit(coeffs=(a * factor, b * factor, c * factor), max_bytes_per_s=fit.max_bytes_per_s * factor,
                        latency_s=fit.latency_s + extra_latency_s)


def class_fits(seed_links: Iterable[NetworkLink]) -> dict[tuple[str, int], BandwidthFit]:
    """(class, GPU count) -> fit: the seed's measured A100-40 fits per class; 8 GPUs share what 4 measured."""
    by = {(lk.sender_zone, lk.sender_gpu, lk.sender_count, lk.receiver_zone, lk.receiver_gpu, lk.receiver_count):
          lk.fit for lk in seed_links}
    fits = {}
    for cls, (a, b) in SEED_CLASS_ZONES.items():
        for c in (1, 2, 4):
            fits[(cls, c)] = by[(a, REFERENCE_GPU, c, b, REFERENCE_GPU, c)]
        fits[(cls, 8)] = fits[(cls, 4)]
    for c in (1, 2, 4, 8):
        fits[("ocean", c)] = scaled(fits[("continent", c)], OCEAN_BANDWIDTH_FACTOR, OCEAN_EXTRA_LATENCY_S)
    return fits


def nic_factors(seed_links: Iterable[NetworkLink], gpu_types: Sequence[str]) -> dict[str, float]:
    """Each type's same-zone, 1-GPU seed bandwidth over A100-40's (the slower end of a link sets its speed)."""
    peak = {lk.sender_gpu: lk.fit.max_bytes_per_s for lk in seed_links
            if lk.sender_zone == lk.receiver_zone == SEED_CLASS_ZONES["zone"][0] and lk.sender_gpu == lk.receiver_gpu
            and lk.sender_count == lk.receiver_count == 1}
    return {g: peak[g] / peak[REFERENCE_GPU] for g in gpu_types}


def network_links(zones: Sequence[str], gpu_types: Sequence[str], per_node: dict[str, int],
                  fits: dict[tuple[str, int], BandwidthFit], nic: dict[str, float]) -> list[NetworkLink]:
    anchor = anchors(zones)
    out = []
    for a in zones:
        for b in zones:
            cls = zone_class(a, b)
            for ga in gpu_types:
                for gb in gpu_types:
                    if not profiled(a, ga, b, gb, anchor):
                        continue
                    counts = (1, 2, 4, 8) if per_node[ga] >= 8 and per_node[gb] >= 8 else (1, 2, 4)
                    k = min(nic[ga], nic[gb])
                    out += [NetworkLink(sender_zone=a, sender_gpu=ga, sender_count=c, receiver_zone=b,
                                        receiver_gpu=gb, receiver_count=c, fit=scaled(fits[(cls, c)], k))
                            for c in counts]
    return out


def gpu_prices(zones: Sequence[str], gpu_types: Sequence[str], seed_prices: Iterable[GpuPrice]) -> list[GpuPrice]:
    base = {p.gpu_type: p.usd_per_gpu_hour for p in seed_prices
            if p.zone == SEED_CLASS_ZONES["zone"][0] and p.market == Market.ON_DEMAND}
    base = {**EXTRA_USD_PER_GPU_HOUR, **base}
    out = []
    for z in zones:
        for g in gpu_types:
            usd = round(base[g] * REGION_PRICE_FACTOR[region_of(z)], 6)
            out += [GpuPrice(cloud="gcp", zone=z, gpu_type=g, market=Market.ON_DEMAND, usd_per_gpu_hour=usd,
                             fetched_at=RECORDED_AT),
                    GpuPrice(cloud="gcp", zone=z, gpu_type=g, market=Market.SPOT,
                             usd_per_gpu_hour=round(usd * SPOT_FACTOR, 6), fetched_at=RECORDED_AT)]
    return out


def build_store(uri: str, zones: Sequence[str] = ZONES, gpu_types: Sequence[str] = TYPES) -> dict[str, int]:
    """Write the synthetic store at `uri` (see the module's contract); rows written per table.

    Every table the profile book reads is written whole (a replace), so the seed under a store opened the
    usual way adds nothing to it."""
    seed = open_store(str(SEED_DIR), seed=False)  # the seed folder is laid out as a store: read it as one
    store = open_store(uri, seed=False)
    known = seed.gpu_types()
    per_node = {g: known[g].gpus_per_node for g in gpu_types}
    links = seed.read(NETWORK_LINKS)
    rows = {"gpu_types": store.write(GPU_TYPES, [known[g] for g in gpu_types], mode="replace",
                                     provenance=PROVENANCE),
            "model_layers": store.write(MODELS, [seed.model(MODEL)], provenance=PROVENANCE),
            "layer_profiles": sum(store.replace_layer_profiles(
                MODEL, g, seed.read(LAYER_PROFILES, {"model": MODEL, "gpu_type": g}), provenance=PROVENANCE)
                for g in gpu_types)}
    intra = [x for x in seed.read(INTRA_NODE_LINKS) if x.gpu_type in gpu_types]
    rows["intra_node_links"] = store.write(INTRA_NODE_LINKS, intra, mode="replace", provenance=PROVENANCE)
    made = network_links(zones, gpu_types, per_node, class_fits(links), nic_factors(links, gpu_types))
    rows["network_links"] = store.write(NETWORK_LINKS, made, mode="replace", provenance=PROVENANCE)
    egress = [EgressPrice(sender_zone=a, receiver_zone=b, usd_per_gb=egress_usd_per_gb(a, b))
              for a in zones for b in zones]
    rows["egress_prices"] = store.write(EGRESS_PRICES, egress, mode="replace", provenance=PROVENANCE)
    prices = gpu_prices(zones, gpu_types, seed.read(GPU_PRICES))
    rows["gpu_prices"] = store.write(GPU_PRICES, prices, mode="replace", provenance=PROVENANCE)
    return rows


def load_book(uri: str) -> ProfileBook:
    """The book `sailor plan --store URI` plans with (sailor_cli/options.py load_book: the store over the seed)."""
    return open_store(uri).profile_book(MODEL)


# -- pools ----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Entry:
    """One pool entry: `count` GPUs of `gpu_type` in `zone` on `market` (price: the store's unless given)."""

    zone: str
    gpu_type: str
    count: int
    market: str = "on-demand"
    usd_per_gpu_hour: float | None = None

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.zone, self.gpu_type, self.market)


def pool_document(entries: Sequence[Entry]) -> dict[str, Any]:
    """The pool file's mapping (docs/planner.md) of `entries`."""
    zones: dict[str, Any] = {}
    for e in entries:
        spec: dict[str, Any] = {"count": e.count, "market": e.market}
        if e.usd_per_gpu_hour is not None:
            spec["usd_per_gpu_hour"] = e.usd_per_gpu_hour
        zones.setdefault(e.zone, {"gpus": {}})["gpus"].setdefault(e.gpu_type, []).append(spec)
    return {"zones": zones}


def describe(entries: Sequence[Entry]) -> str:
    zones = {e.zone for e in entries}
    types = {e.gpu_type for e in entries}
    spot = sum(e.count for e in entries if e.market == "spot")
    return (f"{len(zones)}z {len(types)}t {sum(e.count for e in entries):4d} GPUs"
            + (f" ({spot} spot)" if spot else ""))


def listing(entries: Sequence[Entry]) -> str:
    """Every entry on one line (what a violation report prints)."""
    return ", ".join(f"{e.gpu_type} x{e.count}@{e.zone}" + (f" spot {e.usd_per_gpu_hour}" if e.market == "spot" else "")
                     for e in sorted(entries, key=lambda e: (ZONES.index(e.zone) if e.zone in ZONES else 99,
                                                             e.gpu_type, e.market)))


LADDER_WEIGHT = {"A100-40": 1.0, "V100-16": 1.5, "GH-96": 0.5, "A100-80": 0.75, "Titan-RTX": 1.25}  # scarcer types


def ladder_pool(zones: int, types: int, gpus: int, per_node: dict[str, int]) -> list[Entry]:
    """The first `zones` zones x the first `types` types, about `gpus` GPUs shared by LADDER_WEIGHT in whole
    VMs (at least one per entry); the remainder goes a VM at a time to the entries furthest below their share."""
    names = TYPES[:types]
    total_w = sum(LADDER_WEIGHT[g] for g in names) * zones
    want = {(z, g): gpus * LADDER_WEIGHT[g] / total_w for z in ZONES[:zones] for g in names}
    have = {k: max(per_node[k[1]], int(w // per_node[k[1]]) * per_node[k[1]]) for k, w in want.items()}
    while True:
        room = [k for k in have if sum(have.values()) + per_node[k[1]] <= gpus]
        if not room:
            break
        k = max(room, key=lambda k: (want[k] - have[k], -ZONES.index(k[0]), -names.index(k[1])))
        if want[k] - have[k] <= 0:
            break
        have[k] += per_node[k[1]]
    return [Entry(zone=z, gpu_type=g, count=n) for (z, g), n in have.items()]


# -- one search, in a child that is killed when it runs too long ----------------------------------


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one search gave: times, the chosen plan's figures, the proven gap, or why there is none."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    feasible: bool = False
    iterations_per_s: float = 0.0
    usd_per_iteration: float = 0.0
    usd_per_hour: float = 0.0
    gap: float | None = None
    num_gpus: int = 0
    summary: str = ""
    frontier_better: int = 0  # frontier points better on the objective than the chosen plan (beyond tolerance)
    skipped: tuple[str, ...] = ()  # passes the time budget left out (`SearchStats.skipped`, where it exists)
    killed: bool = False
    error: str = ""

    def value(self, objective: Objective) -> float:
        return self.usd_per_iteration if objective is Objective.MIN_COST else self.iterations_per_s

    def shown(self, objective: Objective) -> str:
        if self.killed:
            return f"killed after {self.wall_s:.0f} s"
        if self.error:
            return f"error: {self.error}"
        if not self.feasible:
            return "no plan"
        if objective is Objective.MIN_COST:
            return f"{self.usd_per_iteration:.5f} USD/it"
        return f"{self.iterations_per_s:.4f} it/s"


def better(objective: Objective, a: float, b: float, tolerance: float) -> bool:
    """Whether value `a` beats `b` on the objective by more than `tolerance` (relative)."""
    if objective is Objective.MIN_COST:
        return a < b * (1 - tolerance)
    return a > b * (1 + tolerance)


def is_violation(objective: Objective, small: Outcome, large: Outcome, tolerance: float) -> bool:
    """The larger pool's plan is worse than the smaller pool's by more than `tolerance` (or missing)."""
    if not small.feasible or small.killed or large.killed or small.error or large.error:
        return False
    if not large.feasible:
        return True
    if objective is Objective.MIN_COST:
        return large.usd_per_iteration > small.usd_per_iteration * (1 + tolerance)
    return large.iterations_per_s < small.iterations_per_s * (1 - tolerance)


def outcome_of(req: PlanRequest, res: PlanResult, wall_s: float, cpu_s: float) -> Outcome:
    e = res.estimate
    if res.plan is None or e is None:
        return Outcome(wall_s=wall_s, cpu_s=cpu_s, gap=getattr(res.stats, "gap", None),
                       summary=res.nearest_miss.splitlines()[0] if res.nearest_miss else "")
    front = 0
    if req.constraints == Constraints():  # with limits the frontier may list points that break them
        tol = req.options.tolerance
        value = e.usd_per_iteration if req.objective is Objective.MIN_COST else e.throughput_iterations_per_s
        front = sum(better(req.objective, f.usd_per_iteration if req.objective is Objective.MIN_COST
                           else f.iterations_per_s, value, tol) for f in res.frontier)
    return Outcome(wall_s=wall_s, cpu_s=cpu_s, feasible=True, iterations_per_s=e.throughput_iterations_per_s,
                   usd_per_iteration=e.usd_per_iteration, usd_per_hour=e.usd_per_hour,
                   gap=getattr(res.stats, "gap", None), num_gpus=res.plan.num_gpus, summary=summarize(res.plan),
                   frontier_better=front, skipped=tuple(getattr(res.stats, "skipped", ())))


def _child(req: PlanRequest, book: ProfileBook, conn: Connection) -> None:
    try:
        c0, t0 = time.process_time(), time.perf_counter()
        res = plan(req, book)
        out = outcome_of(req, res, time.perf_counter() - t0, time.process_time() - c0)
    except Exception as e:  # noqa: BLE001 - reported as the search's outcome, with its type
        out = Outcome(error=f"{type(e).__name__}: {' '.join(str(e).split())[:300]}")
    conn.send(dataclasses.asdict(out))  # plain values: the parent rebuilds the Outcome
    conn.close()


def run_search(req: PlanRequest, book: ProfileBook, kill_after_s: float) -> Outcome:
    """`plan(req, book)` in a forked child (the book is shared, not copied), killed after `kill_after_s`."""
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(req, book, send), daemon=True)
    t0 = time.perf_counter()
    child.start()
    send.close()
    try:
        if recv.poll(kill_after_s):
            return Outcome(**recv.recv())
        return Outcome(killed=True, wall_s=time.perf_counter() - t0)
    except EOFError:
        return Outcome(error=f"the search's process died (exit {child.exitcode})", wall_s=time.perf_counter() - t0)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        recv.close()


def request(book: ProfileBook, entries: Sequence[Entry], objective: Objective,
            constraints: Constraints = Constraints(), budget_s: float | None = None) -> PlanRequest:
    return PlanRequest(model=MODEL, global_batch_size=GLOBAL_BATCH, pool=parse_pool(pool_document(entries), book),
                       objective=objective, constraints=constraints, options=SearchOptions(max_search_s=budget_s))


# -- the ladder -----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Rung:
    zones: int
    types: int
    gpus: int
    objective: Objective = Objective.MAX_THROUGHPUT
    budget_s: float | None = None  # SearchOptions.max_search_s (None: no budget)
    target_s: float | None = None  # issue 43's search time for this pool


BUDGET_S = 10.0
LADDER = (
    Rung(zones=1, types=1, gpus=64),
    Rung(zones=1, types=2, gpus=128),
    Rung(zones=1, types=3, gpus=256),
    Rung(zones=2, types=2, gpus=256),
    Rung(zones=4, types=2, gpus=384),
    Rung(zones=4, types=3, gpus=448),
    Rung(zones=5, types=2, gpus=768),
    Rung(zones=5, types=3, gpus=1000, target_s=1.0),
    Rung(zones=5, types=3, gpus=1000, objective=Objective.MIN_COST),
    Rung(zones=9, types=4, gpus=2048, budget_s=BUDGET_S),
    Rung(zones=12, types=5, gpus=3072, budget_s=BUDGET_S),
    Rung(zones=20, types=5, gpus=4096, budget_s=BUDGET_S, target_s=BUDGET_S),
    Rung(zones=20, types=5, gpus=4096, objective=Objective.MIN_COST, budget_s=BUDGET_S),
)
QUICK_LADDER = (
    Rung(zones=1, types=1, gpus=64),
    Rung(zones=1, types=2, gpus=128),
    Rung(zones=2, types=3, gpus=192),
    Rung(zones=1, types=2, gpus=128, objective=Objective.MIN_COST),
)


def kill_after(budget_s: float | None, default_s: float) -> float:
    """How long a search may run before its child is killed: a budget's triple plus 30 s, else `default_s`."""
    return default_s if budget_s is None else 3 * budget_s + 30


def fmt_gap(gap: float | None) -> str:
    return "unknown" if gap is None else "optimal" if gap == 0 else f"{gap * 100:.2f}%"


def run_ladder(book: ProfileBook, rungs: Sequence[Rung], default_kill_s: float,
               say: Report) -> list[tuple[Rung, list[Entry], Outcome]]:
    per_node = {g: t.gpus_per_node for g, t in book.gpu_types.items()}
    say(f"\n== ladder: {MODEL}, global batch {GLOBAL_BATCH}; budget = SearchOptions(max_search_s); gap: "
        f"stats.gap over one-kind plans (passes the budget skipped are named)")
    say(f"{'pool':24} {'objective':15} {'budget':>6} {'wall s':>8} {'cpu s':>8} {'target':>6} {'wall/tgt':>8} "
        f"{'value':>16} {'USD/it':>9} {'gap':>8} {'GPUs':>5}  plan")
    out = []
    for r in rungs:
        entries = ladder_pool(r.zones, r.types, r.gpus, per_node)
        o = run_search(request(book, entries, r.objective, budget_s=r.budget_s), book,
                       kill_after(r.budget_s, default_kill_s))
        out.append((r, entries, o))
        budget = "-" if r.budget_s is None else f"{r.budget_s:g}s"
        target = "-" if r.target_s is None else f"{r.target_s:g}s"
        ratio = "-" if r.target_s is None else f"{o.wall_s / r.target_s:.2f}"
        usd = f"{o.usd_per_iteration:.5f}" if o.feasible else "-"
        skipped = f"[budget skipped: {', '.join(o.skipped)}] " if o.skipped else ""
        say(f"{describe(entries):24} {r.objective.value:15} {budget:>6} {o.wall_s:8.3f} {o.cpu_s:8.3f} {target:>6} "
            f"{ratio:>8} {o.shown(r.objective):>16} {usd:>9} {fmt_gap(o.gap):>8} {o.num_gpus:5d}  "
            f"{skipped}{o.summary[:110]}")
    return out


# -- the monotonicity sweep -----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Pair:
    """A pool and a larger one (`growth` says what it adds), planned for the same objective and limits."""

    small: tuple[Entry, ...]
    large: tuple[Entry, ...]
    growth: str
    objective: Objective = Objective.MAX_THROUGHPUT
    # a limit set from the smaller pool's fastest plan: max USD/hour = factor x what it costs per hour (max
    # throughput), or min it/s = factor x its speed (min cost)
    limit_factor: float | None = None


@dataclass(frozen=True, kw_only=True)
class PairResult:
    pair: Pair
    constraints: Constraints
    small: Outcome
    large: Outcome
    violation: bool
    searches: int


def pick_zones(rng: random.Random, n: int, zones: Sequence[str], taken: Sequence[str] = ()) -> list[str]:
    """`n` zones not in `taken`, each near one already picked (same region 50%, continent 30%) or anywhere."""
    picked = list(taken)
    for _ in range(n):
        free = [z for z in zones if z not in picked]
        if not free:
            break
        r, near = rng.random(), rng.choice(picked) if picked else None
        pool = (free if near is None else [z for z in free if region_of(z) == region_of(near)] if r < 0.5
                else [z for z in free if continent_of(z) == continent_of(near)] if r < 0.8 else free)
        picked.append(rng.choice(pool or free))
    return picked[len(taken):]


def random_pool(rng: random.Random, per_node: dict[str, int], max_gpus: int, zones: Sequence[str],
                types: Sequence[str]) -> list[Entry]:
    """1-4 zones, 1-3 GPU types (GH-96, whose links are partial, in about half), whole VMs, <= `max_gpus`."""
    chosen = rng.sample(list(types), min(len(types), rng.choice((1, 2, 2, 3))))
    if "GH-96" in types and "GH-96" not in chosen and rng.random() < 0.35:
        chosen[-1] = "GH-96"
    entries = []
    for z in pick_zones(rng, rng.choice((1, 1, 2, 2, 3, 4)), zones):
        here = [g for g in chosen if rng.random() < 0.8] or [rng.choice(chosen)]
        entries += [Entry(zone=z, gpu_type=g, count=per_node[g] * rng.choice((1, 2, 4, 8))) for g in here]
    while sum(e.count for e in entries) > max_gpus:
        i = max(range(len(entries)), key=lambda i: entries[i].count)
        e = entries[i]
        if e.count <= per_node[e.gpu_type]:
            entries.pop(i)
        else:
            entries[i] = dataclasses.replace(e, count=max(per_node[e.gpu_type], e.count // 2 // per_node[e.gpu_type]
                                                          * per_node[e.gpu_type]))
    return entries


def grow(rng: random.Random, entries: list[Entry], book: ProfileBook, zones: Sequence[str],
         types: Sequence[str]) -> tuple[list[Entry], str]:
    """`entries` with capacity added (more GPUs of an entry, a zone, a GPU type or a spot market), and what."""
    per_node = {g: t.gpus_per_node for g, t in book.gpu_types.items()}
    have_types = sorted({e.gpu_type for e in entries})
    have_zones = sorted({e.zone for e in entries}, key=zones.index)
    how = rng.choice(("gpus", "zone", "type", "market"))
    if (how == "type" and len(have_types) == len(types)) or (how == "zone" and len(have_zones) == len(zones)):
        how = "gpus"
    if how == "gpus":
        i = rng.randrange(len(entries))
        e = entries[i]
        add = per_node[e.gpu_type] * rng.choice((1, 2, 4, 8))
        return entries[:i] + [dataclasses.replace(e, count=e.count + add)] + entries[i + 1:], \
            f"+{add} {e.gpu_type}@{e.zone}{' spot' if e.market == 'spot' else ''}"
    if how == "zone":
        z = pick_zones(rng, 1, zones, have_zones)[0]
        kinds = have_types if rng.random() < 0.7 else list(types)
        new = [Entry(zone=z, gpu_type=g, count=per_node[g] * rng.choice((1, 2, 4)))
               for g in rng.sample(kinds, rng.randint(1, min(2, len(kinds))))]
        return entries + new, f"+zone {z} ({', '.join(f'{e.gpu_type} x{e.count}' for e in new)})"
    if how == "type":
        g = rng.choice([t for t in types if t not in have_types])
        where = rng.sample(have_zones, rng.randint(1, len(have_zones)))
        n = per_node[g] * rng.choice((1, 2, 4))
        return entries + [Entry(zone=z, gpu_type=g, count=n) for z in where], f"+type {g} x{n} in {len(where)} zone(s)"
    return spot_copy(rng, entries, book, per_node)


def spot_copy(rng: random.Random, entries: list[Entry], book: ProfileBook,
              per_node: dict[str, int]) -> tuple[list[Entry], str]:
    """A spot market beside an entry: a spot copy at about the store's spot price (or more GPUs of its spot entry)."""
    e = rng.choice(entries)
    n = per_node[e.gpu_type] * rng.choice((1, 2, 4, 8))
    spot = next((i for i, s in enumerate(entries) if s.key == (e.zone, e.gpu_type, "spot")), None)
    if spot is not None:
        s = entries[spot]
        return entries[:spot] + [dataclasses.replace(s, count=s.count + n)] + entries[spot + 1:], \
            f"+{n} {e.gpu_type}@{e.zone} spot"
    listed = book.price_usd_per_gpu_hour(e.zone, e.gpu_type, Market.SPOT) or 1.0
    usd = round(listed * rng.uniform(0.8, 1.2), 4)
    return entries + [Entry(zone=e.zone, gpu_type=e.gpu_type, count=n, market="spot", usd_per_gpu_hour=usd)], \
        f"+spot {e.gpu_type} x{n}@{e.zone} at {usd} USD/GPU-h"


def make_pairs(rng: random.Random, book: ProfileBook, n: int, max_gpus: int = 256, zones: Sequence[str] = ZONES,
               types: Sequence[str] = TYPES) -> list[Pair]:
    """`n` random pairs (see the module's contract); the same `rng` seed gives the same pairs."""
    per_node = {g: t.gpus_per_node for g, t in book.gpu_types.items()}
    pairs = []
    for _ in range(n):
        small = random_pool(rng, per_node, max_gpus, zones, types)
        large, growth = grow(rng, list(small), book, zones, types)
        objective = Objective.MIN_COST if rng.random() < 0.25 else Objective.MAX_THROUGHPUT
        factor = None
        if rng.random() < 0.15:
            factor = round(rng.uniform(0.3, 0.8), 3)
        pairs.append(Pair(small=tuple(small), large=tuple(large), growth=growth, objective=objective,
                          limit_factor=factor))
    return pairs


def larger_pairs() -> list[Pair]:
    """A handful of larger pairs, the issue's own first: 4 zones x (A100-40 x32, V100-16 x64), then GH-96 x16 added."""
    c4, c5 = ZONES[:4], ZONES[:5]

    def each(zs: Sequence[str], gpu: str, n: int, market: str = "on-demand") -> list[Entry]:
        return [Entry(zone=z, gpu_type=gpu, count=n, market=market) for z in zs]

    base4 = each(c4, "A100-40", 32) + each(c4, "V100-16", 64)
    five2 = each(c5, "A100-40", 64) + each(c5, "V100-16", 96)
    five3 = five2 + each(c5, "GH-96", 40)
    far = ("us-central1-a", "europe-west4-a", "asia-east1-a")
    three = each(far, "A100-80", 32) + each(far, "V100-16", 64)
    return [
        Pair(small=tuple(base4), large=tuple(base4 + each(c4, "GH-96", 16)), growth="issue 43: +GH-96 x16 in 4 zones"),
        Pair(small=tuple(five2), large=tuple(five3), growth="+GH-96 x40 in 5 zones"),
        Pair(small=tuple(five3), large=tuple(five3 + each(("europe-west4-a",), "A100-40", 64)),
             growth="+zone europe-west4-a (A100-40 x64)"),
        Pair(small=tuple(base4), large=tuple(base4 + each(c4, "V100-16", 64, "spot")),
             growth="+spot V100-16 x64 in 4 zones (store's spot price)"),
        Pair(small=tuple(three), large=tuple(three + each(far, "A100-40", 32)), growth="+A100-40 x32 on 3 continents"),
        Pair(small=tuple(five3), large=tuple(five3 + each(c5, "A100-80", 32)), objective=Objective.MIN_COST,
             growth="+type A100-80 x32 in 5 zones (min cost)"),
    ]


def limits(pair: Pair, book: ProfileBook, kill_s: float) -> tuple[Constraints, int]:
    """The pair's limit, a fraction of what the smaller pool's fastest plan costs per hour (max throughput) or
    runs (min cost): a person with part of that budget, or needing part of that speed; (limits, searches run)."""
    if pair.limit_factor is None:
        return Constraints(), 0
    fastest = run_search(request(book, pair.small, Objective.MAX_THROUGHPUT), book, kill_s)
    if not fastest.feasible:
        return Constraints(), 1
    if pair.objective is Objective.MAX_THROUGHPUT:
        return Constraints(max_usd_per_hour=fastest.usd_per_hour * pair.limit_factor), 1
    return Constraints(min_iterations_per_s=fastest.iterations_per_s * pair.limit_factor), 1


def run_pair(pair: Pair, book: ProfileBook, kill_s: float) -> PairResult:
    cons, pre = limits(pair, book, kill_s)
    small = run_search(request(book, pair.small, pair.objective, cons), book, kill_s)
    large = run_search(request(book, pair.large, pair.objective, cons), book, kill_s)
    tol = SearchOptions().tolerance
    return PairResult(pair=pair, constraints=cons, small=small, large=large, searches=pre + 2,
                      violation=is_violation(pair.objective, small, large, tol))


def limit_text(c: Constraints) -> str:
    if c.max_usd_per_hour is not None:
        return f" <= {c.max_usd_per_hour:.2f} USD/h"
    if c.min_iterations_per_s is not None:
        return f" >= {c.min_iterations_per_s:.4f} it/s"
    return ""


def run_sweep(pairs: Sequence[Pair], book: ProfileBook, kill_s: float, say: Report) -> list[PairResult]:
    tol = SearchOptions().tolerance
    say(f"\n== monotonicity sweep: {len(pairs)} (pool, larger pool) pairs; a violation: the larger pool's plan "
        f"worse by more than the tolerance ({tol:.1%})")
    say(f"{'#':>4} {'objective, limit':34} {'pool':22} {'added':44} {'small':>16} {'large':>16} {'large/small':>11} "
        f"{'verdict':9} search s")
    out = []
    for i, pair in enumerate(pairs):
        r = run_pair(pair, book, kill_s)
        out.append(r)
        o = pair.objective
        ratio = (f"{r.large.value(o) / r.small.value(o):.4f}" if r.small.feasible and r.large.feasible
                 and r.small.value(o) > 0 else "-")
        verdict = ("VIOLATION" if r.violation else "killed" if r.small.killed or r.large.killed
                   else "error" if r.small.error or r.large.error else "ok")
        say(f"{i:4d} {o.value + limit_text(r.constraints):34} {describe(pair.small):22} {pair.growth[:44]:44} "
            f"{r.small.shown(o):>16} {r.large.shown(o):>16} {ratio:>11} {verdict:9} "
            f"{r.small.wall_s:.2f} / {r.large.wall_s:.2f}")
    for i, r in enumerate(out):
        what = ("VIOLATION" if r.violation else "KILLED" if r.small.killed or r.large.killed
                else "ERROR" if r.small.error or r.large.error else "")
        if what:
            say_pair(what, i, r, say)
    return out


def say_pair(what: str, i: int, r: PairResult, say: Report) -> None:
    """Both pools and both plans of pair `i` (a violation, or a search killed or failed)."""
    o = r.pair.objective
    say(f"\n{what} in pair {i}: {o.value}{limit_text(r.constraints)}, {r.pair.growth}: "
        f"{r.small.shown(o)} on the smaller pool, {r.large.shown(o)} on the larger")
    for name, entries, got in (("smaller", r.pair.small, r.small), ("larger", r.pair.large, r.large)):
        say(f"  {name} pool ({describe(entries)}): {listing(entries)}")
        figures = (f"{got.iterations_per_s:.4f} it/s, {got.usd_per_iteration:.5f} USD/it, {got.num_gpus} GPUs"
                   if got.feasible else got.shown(o))
        say(f"  {name} plan: {figures}, search {got.wall_s:.2f} s wall, {got.cpu_s:.2f} s CPU: {got.summary}")


# -- output and the run ---------------------------------------------------------------------------


class Report:
    """Prints each line and writes it to `path` as it goes (a run cut short keeps what it printed)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: TextIO | None = None

    def __enter__(self) -> Report:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        if self._file is not None:
            self._file.write(text + "\n")
            self._file.flush()


def load_text() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def summary(ladder: Sequence[tuple[Rung, list[Entry], Outcome]], sweep: Sequence[PairResult], say: Report) -> int:
    """The closing lines (the last one the issue's) and the exit status."""
    outcomes = [o for _, _, o in ladder] + [x for r in sweep for x in (r.small, r.large)]
    slowest = max(ladder, key=lambda t: t[2].wall_s)
    gaps = [o.gap for _, _, o in ladder]
    worst_gap = "unknown" if not gaps or any(g is None for g in gaps) else f"{max(g or 0.0 for g in gaps) * 100:.2f}"
    violations = sum(r.violation for r in sweep)
    killed = sum(o.killed for o in outcomes)
    errors = sum(bool(o.error) for o in outcomes)
    misses = [(r, o) for r, _, o in ladder if r.target_s is not None and o.cpu_s > r.target_s]
    front = sum(o.frontier_better > 0 for o in outcomes)
    say("\n== summary")
    for r, entries, o in ladder:
        if r.target_s is not None:
            say(f"target: {describe(entries)} {r.objective.value} within {r.target_s:g} s: wall {o.wall_s:.3f} s, "
                f"cpu {o.cpu_s:.3f} s ({'OK' if o.cpu_s <= r.target_s and o.feasible else 'SHORT'} by CPU time), "
                f"gap {fmt_gap(o.gap)}")
    say(f"ladder: {len(ladder)} pools, slowest search {slowest[2].wall_s:.3f} s wall ({describe(slowest[1])} "
        f"{slowest[0].objective.value}); sweep: {len(sweep)} pairs, {sum(r.searches for r in sweep)} searches, "
        f"{violations} violations; killed {killed}, errors {errors}; plans whose frontier lists a point better than "
        f"the chosen one beyond the tolerance: {front}; load average now {load_text()}")
    say(f"pools={len(ladder) + 2 * len(sweep)} slowest_s={slowest[2].wall_s:.3f} violations={violations} "
        f"worst_gap_pct={worst_gap}")
    return 1 if violations or killed or errors or misses else 0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 small rungs and 20 pairs (a check, not the measure)")
    ap.add_argument("--pairs", type=int, default=None, help="random pairs of the sweep (default 200; --quick 20)")
    ap.add_argument("--seed", type=int, default=43, help="seed of the sweep's pools (default 43)")
    ap.add_argument("--out", default=str(OUT), help=f"also write the output here (default {OUT.relative_to(REPO)}; "
                    f"'' for none)")
    ap.add_argument("--store", default=None, help="generate the store into this folder and keep it (default: a "
                    "temporary folder, removed at exit)")
    ap.add_argument("--kill-after", type=float, default=120.0,
                    help="seconds a search without a budget may run before it is killed (default 120)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    pairs_n = a.pairs if a.pairs is not None else 20 if a.quick else 200
    tmp = None if a.store else tempfile.mkdtemp(prefix="sailor-bench-scale-")
    uri = a.store or str(Path(tmp or "") / "store")
    try:
        with Report(Path(a.out) if a.out else None) as say:
            say(f"bench_planner_scale{' --quick' if a.quick else ''}: seed {a.seed}, load average {load_text()} "
                f"(1, 5, 15 min), {os.cpu_count()} CPUs")
            t0 = time.perf_counter()
            rows = build_store(uri)
            book = load_book(uri)
            say(f"store {'kept at ' + uri if a.store else '(temporary)'}: {len(ZONES)} zones, "
                f"{len({region_of(z) for z in ZONES})} regions, {len(CONTINENT)} continents, types {', '.join(TYPES)}; "
                + ", ".join(f"{k} {v}" for k, v in rows.items()) + f" rows; written and read back in "
                f"{time.perf_counter() - t0:.1f} s; the book holds {len(book.links)} links")
            for g, why in PARTIAL.items():
                say(f"partial links: {g}: {why}")
            ladder = run_ladder(book, QUICK_LADDER if a.quick else LADDER, a.kill_after, say)
            pairs = make_pairs(random.Random(a.seed), book, pairs_n) + ([] if a.quick else larger_pairs())
            sweep = run_sweep(pairs, book, a.kill_after, say)
            return summary(ladder, sweep, say)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
