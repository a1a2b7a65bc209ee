"""Availability and price traces: how many GPUs of each type could be rented where, on which market,
at what price, over time.

Contract: a `Trace` is a step function over time. `places` fixes the (zone, GPU type, market)
columns once; `points[i]` says, from `points[i].at_s` seconds after the start until the next
point, how many GPUs each place offers in total (what a job may hold there, its own VMs
included) and at what USD per GPU-hour. The last point holds for ever after. `pool_at(i)` is that
state as the planner's `ResourcePool`. Readers (all pure: they take text, never open files):

- `parse_sailor_trace(data)`: ours, JSON, dense (one row of counts and prices per point):
      {"format": "sailor-trace", "version": 1, "name": "...",
       "places": [{"zone": "us-central1-a", "gpu_type": "A100-40", "market": "spot",
                   "region": "us-central1", "cloud": "gcp", "gpus_per_node": 4}, ...],
       "points": [{"at_s": 0, "counts": [64, ...], "usd_per_gpu_hour": [1.2, ...]}, ...]}
- `parse_changes_csv(text, ...)`: ours, CSV, sparse: one row per change of one place,
  `at_s,zone,gpu_type,market,count,usd_per_gpu_hour` (an empty cell keeps the place's previous
  value). A spot price history exported from the store (the `gpu_prices` table's columns:
  `cloud,zone,gpu_type,market,usd_per_gpu_hour,fetched_at`) reads the same way: `fetched_at`
  stands for `at_s` and, having no `count` column, every place offers `default_count` GPUs.
- `parse_artifact_csv(text, ...)`: the Sailor artifact's `gpu_trace_*.csv` (a `Timestamp` column
  and one `<gpu_type>_<zone>` column of GPU counts per place).
- `parse_artifact_json(data, ...)`: the artifact's controller traces (`trace_based/*.json`, a list
  of {"Time": s, "GPUs": n}) for one place.
The artifact's traces carry no market or price: the caller names the market and a price lookup
(the store's prices). Every problem raises `TraceError` (one line: what was wrong; to fix: ...).
"""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sailor_core.domain import Capacity, Market, ResourcePool, default_region
from sailor_core.errors import TraceError, ValidationError
from sailor_core.files import check_name, parse_json, shown, shown_text

TRACE_FORMAT = "sailor-trace"
TRACE_VERSION = 1

PriceLookup = Callable[[str, str, Market], float | None]

# Limits of a trace (docs/formats.md, "Limits"): what the readers accept, so that any file is read and checked,
# or refused with one line, in bounded time; the values' bounds hold for every trace, however it was made.
MAX_TRACE_BYTES = 16 << 20  # a month of minute points for 20 places is ~10 MB
MAX_PLACES = 4096  # as a pool's entries
MAX_POINTS = 100_000  # a file's points (a synthetic trace may hold more)
MAX_AT_S = 10 * 366 * 86400.0  # ten years
MAX_STEP = 10**12
MAX_GPUS = 100_000  # GPUs of one place, as a pool entry's count
MAX_GPUS_PER_NODE = 64
MAX_USD_PER_GPU_HOUR = 1000.0
MAX_FACTOR = 1000.0  # a calibration factor
MAX_RECONFIGURATION_S = 86400.0
MAX_HAPPENED = 8  # the kinds that woke a replan (a run's history): short identifiers


@dataclass(frozen=True, kw_only=True)
class Place:
    """One column of a trace: GPUs of one type in one zone on one market."""

    zone: str
    gpu_type: str
    market: Market
    region: str = ""
    cloud: str = "gcp"
    gpus_per_node: int = 1

    def __post_init__(self) -> None:
        problems: list[str] = []
        for what in ("zone", "gpu_type", "cloud") + (("region",) if self.region else ()):
            object.__setattr__(self, what, check_name(getattr(self, what), f"place {what}", problems))
        if problems:
            raise ValidationError(problems[0])
        object.__setattr__(self, "market", Market.parse(self.market))
        if not self.region:
            object.__setattr__(self, "region", default_region(self.zone))
        if not 1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE:
            raise ValidationError(f"place {self.gpu_type}@{self.zone}: gpus_per_node must be from 1 to "
                                  f"{MAX_GPUS_PER_NODE}, got {shown(self.gpus_per_node)}")

    @property
    def key(self) -> tuple[str, str, Market]:
        return (self.zone, self.gpu_type, self.market)


@dataclass(frozen=True, kw_only=True)
class TracePoint:
    """From `at_s` on: `counts[k]` GPUs at `usd_per_gpu_hour[k]` in place k.

    A point with `at_step` takes effect when the job has trained that many steps instead (a
    run's own history, or a scenario scripted by step); its `at_s` is then ignored. `taken[k]`
    GPUs of running VMs in place k are reclaimed at this point (preempted, or workers lost): a
    job holding GPUs there loses them even if the place still has free capacity (empty: none).
    A run's history also carries what the flow had measured by then: `calibration` (GPU type,
    factor) pairs scale those types' layer times from here on (the flow's online calibration), and
    `reconfiguration_s` replaces the job's reconfiguration time (the flow's measured one), and
    `happened` names what woke the flow's replan there (its trigger: event kinds, "iteration_time"),
    which the replay's decision says instead of what it reads off the trace.
    """

    at_s: float
    counts: tuple[int, ...]
    usd_per_gpu_hour: tuple[float, ...]
    at_step: int | None = None
    taken: tuple[int, ...] = ()
    calibration: tuple[tuple[str, float], ...] = ()
    reconfiguration_s: float | None = None
    happened: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Every value finite and within the limits above (a NaN time compared unequal to itself and a negative
        one started the job before the trace: both ran away)."""
        bad = _bad_time(self.at_s, self.at_step, self.reconfiguration_s)
        bad = bad or ("too many or malformed happened kinds" if len(self.happened) > MAX_HAPPENED or not all(
            k.isidentifier() and len(k) <= 40 for k in self.happened) else "")
        bad = bad or next((f"count {shown(c)}" for c in (*self.counts, *self.taken) if not 0 <= c <= MAX_GPUS), "")
        bad = bad or next((f"price {shown(u)}" for u in self.usd_per_gpu_hour
                           if not 0 <= u <= MAX_USD_PER_GPU_HOUR), "")
        bad = bad or next((f"calibration factor {shown(f)}" for _, f in self.calibration if not 0 < f <= MAX_FACTOR),
                          "")
        if bad:
            raise ValidationError(f"a trace point has {bad}: times are seconds from 0 to {MAX_AT_S:.0f}, counts "
                                  f"0 to {MAX_GPUS:,} GPUs, prices 0 to {MAX_USD_PER_GPU_HOUR:g} USD per GPU-hour, "
                                  f"calibration factors above 0 up to {MAX_FACTOR:g}")


def _bad_time(at_s: float, at_step: int | None, reconfiguration_s: float | None) -> str:
    if not 0 <= at_s <= MAX_AT_S:
        return f"at_s {shown(at_s)}"
    if at_step is not None and not 0 <= at_step <= MAX_STEP:
        return f"at_step {shown(at_step)}"
    if reconfiguration_s is not None and not 0 <= reconfiguration_s <= MAX_RECONFIGURATION_S:
        return f"reconfiguration_s {shown(reconfiguration_s)}"
    return ""


def _number(v: Any, where: str) -> float:
    """`v` (a number, or text of one) as a finite float; else a ValueError naming `where`."""
    if isinstance(v, bool) or not isinstance(v, int | float | str):
        raise ValueError(f"{where} must be a number, got {shown(v)}")
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(f"{where} must be a finite number, got {shown(v)}")
    return x


def _count(v: Any, where: str) -> int:
    """`v` as a whole number (12 or 12.0, or text of one) within a trace's limits; else a ValueError."""
    x = _number(v, where)
    if not x.is_integer() or not 0 <= x <= MAX_STEP:
        raise ValueError(f"{where} must be a whole number from 0 to {MAX_STEP:,}, got {shown(v)}")
    return int(x)


@dataclass(frozen=True, kw_only=True)
class Trace:
    name: str
    places: tuple[Place, ...]
    points: tuple[TracePoint, ...]
    _pools: dict[int, ResourcePool] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", shown_text(str(self.name), 120))  # shown in messages and tables
        if not self.places:
            raise TraceError(f"trace {self.name!r} names no place; to fix: give at least one (zone, GPU type, market)")
        if not self.points:
            raise TraceError(f"trace {self.name!r} has no point; to fix: give at least the state at time 0")
        if len(self.places) > MAX_PLACES:
            raise TraceError(f"trace {self.name!r} has {len(self.places):,} places, more than {MAX_PLACES:,}; to fix: "
                             f"keep the places the job may rent (limits: docs/formats.md)")
        dup = sorted(k for k, n in Counter(p.key for p in self.places).items() if n > 1)
        if dup:
            raise TraceError(f"trace {self.name!r} lists a place twice: {dup[0]}; to fix: merge its columns")
        last = -math.inf
        last_step = 0
        by_step = any(pt.at_step is not None for pt in self.points[1:])
        n = len(self.places)
        for i, pt in enumerate(self.points):
            if by_step and i > 0:
                if pt.at_step is None or pt.at_step < last_step:
                    raise TraceError(f"trace {self.name!r} point {i}: at_step {pt.at_step} is not at or after "
                                     f"step {last_step}; to fix: give every point after the first a step, in order")
                last_step = pt.at_step
            elif not pt.at_s > last:
                raise TraceError(f"trace {self.name!r} point {i}: at_s {pt.at_s} is not after {last}; "
                                 f"to fix: sort the points by time, one per time")
            last = pt.at_s
            if len(pt.counts) != n or len(pt.usd_per_gpu_hour) != n:
                raise TraceError(f"trace {self.name!r} point {i}: {len(pt.counts)} counts and "
                                 f"{len(pt.usd_per_gpu_hour)} prices for {n} places; to fix: one of each per place")
            if pt.taken and len(pt.taken) != n:
                raise TraceError(f"trace {self.name!r} point {i}: {len(pt.taken)} taken counts for {n} places; "
                                 f"to fix: one per place, or none")
            if any(c < 0 for c in pt.counts) or any(not (u >= 0 and math.isfinite(u)) for u in pt.usd_per_gpu_hour):
                raise TraceError(f"trace {self.name!r} point {i}: counts and prices must be >= 0; to fix: correct them")

    @property
    def by_step(self) -> bool:
        return any(pt.at_step is not None for pt in self.points[1:])

    @property
    def duration_s(self) -> float:
        """Time of the last change (its state holds after it)."""
        return self.points[-1].at_s - self.points[0].at_s

    @property
    def max_gpus(self) -> int:
        return max(sum(p.counts) for p in self.points)

    def taken_at(self, i: int) -> dict[tuple[str, str, Market], int]:
        pt = self.points[i]
        return {pl.key: n for pl, n in zip(self.places, pt.taken, strict=True) if n > 0} if pt.taken else {}

    def pool_at(self, i: int) -> ResourcePool:
        pool = self._pools.get(i)
        if pool is None:
            pt = self.points[i]
            pool = ResourcePool(entries=tuple(
                Capacity(zone=pl.zone, region=pl.region, gpu_type=pl.gpu_type, gpus=c, market=pl.market,
                         gpus_per_vm=pl.gpus_per_node, usd_per_gpu_hour=u, cloud=pl.cloud)
                for pl, c, u in zip(self.places, pt.counts, pt.usd_per_gpu_hour, strict=True) if c > 0))
            self._pools[i] = pool
        return pool


def trace_to_json(trace: Trace) -> dict[str, Any]:
    return {
        "format": TRACE_FORMAT, "version": TRACE_VERSION, "name": trace.name,
        "places": [{"zone": p.zone, "gpu_type": p.gpu_type, "market": p.market.value, "region": p.region,
                    "cloud": p.cloud, "gpus_per_node": p.gpus_per_node} for p in trace.places],
        "points": [{"at_s": pt.at_s, "counts": list(pt.counts), "usd_per_gpu_hour": list(pt.usd_per_gpu_hour),
                    **({"at_step": pt.at_step} if pt.at_step is not None else {}),
                    **({"taken": list(pt.taken)} if pt.taken else {}),
                    **({"calibration": [list(c) for c in pt.calibration]} if pt.calibration else {}),
                    **({"reconfiguration_s": pt.reconfiguration_s} if pt.reconfiguration_s is not None else {}),
                    **({"happened": list(pt.happened)} if pt.happened else {})}
                   for pt in trace.points],
    }


def _merge_equal(points: Sequence[TracePoint]) -> tuple[TracePoint, ...]:
    """Drop points that change nothing (the replay decides only where something changed)."""
    out: list[TracePoint] = []
    for pt in points:
        if out and out[-1].counts == pt.counts and out[-1].usd_per_gpu_hour == pt.usd_per_gpu_hour \
                and not any(pt.taken):
            continue
        out.append(pt)
    return tuple(out)


def parse_sailor_trace(data: Any, *, source: str = "trace") -> Trace:
    if not isinstance(data, Mapping) or data.get("format") != TRACE_FORMAT:
        raise TraceError(f"{source}: not a sailor trace (no \"format\": \"{TRACE_FORMAT}\"); "
                         f"to fix: see the trace formats in docs/replay.md")
    if data.get("version") != TRACE_VERSION:
        raise TraceError(f"{source}: trace version {data.get('version')!r} is not {TRACE_VERSION}; "
                         f"to fix: write it with this version of sailor")
    for key, most in (("places", MAX_PLACES), ("points", MAX_POINTS)):
        if isinstance(data.get(key), list) and len(data[key]) > most:
            raise TraceError(f"{source}: {len(data[key]):,} {key}, more than {most:,}; to fix: check the file "
                             f"(limits: docs/formats.md)")
    try:
        places = tuple(Place(zone=p["zone"], gpu_type=p["gpu_type"], market=p.get("market", "on-demand"),
                             region=p.get("region") or "", cloud=p.get("cloud") or "gcp",
                             gpus_per_node=_count(p.get("gpus_per_node") or 1, "gpus_per_node"))
                       for p in data["places"])
        points = tuple(_point(pt) for pt in data["points"])
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{source}: malformed sailor trace ({type(e).__name__}: {shown_text(str(e), 200)}); "
                         f"to fix: see the trace formats in docs/replay.md") from None
    return Trace(name=str(data.get("name") or source), places=places, points=points)


def _point(pt: Mapping[str, Any]) -> TracePoint:
    """One point of our JSON trace; numbers may be written as text ("12"), never as NaN or infinities."""
    return TracePoint(at_s=_number(pt.get("at_s", 0.0), "at_s"),
                      counts=tuple(_count(c, "a count") for c in pt["counts"]),
                      usd_per_gpu_hour=tuple(_number(u, "a price") for u in pt["usd_per_gpu_hour"]),
                      at_step=_count(pt["at_step"], "at_step") if pt.get("at_step") is not None else None,
                      taken=tuple(_count(c, "a taken count") for c in pt.get("taken") or ()),
                      calibration=tuple((str(g), _number(f, "a calibration factor"))
                                        for g, f in pt.get("calibration") or ()),
                      reconfiguration_s=_number(pt["reconfiguration_s"], "reconfiguration_s")
                      if pt.get("reconfiguration_s") is not None else None,
                      happened=tuple(str(k) for k in (pt.get("happened") or ())[:MAX_HAPPENED + 1]))


def _price(lookup: PriceLookup, zone: str, gpu: str, market: Market, source: str) -> float:
    p = lookup(zone, gpu, market)
    if p is None:
        raise TraceError(f"{source}: no {market.value} price for {gpu} in {zone}; to fix: import prices into the "
                         f"store (sailor profiles import-prices) or give the trace's price (--price)")
    return float(p)


def parse_artifact_json(data: Any, *, zone: str, gpu_type: str, market: Market, gpus_per_node: int,
                        prices: PriceLookup, source: str = "trace", cloud: str = "gcp") -> Trace:
    """The artifact's controller trace: [{"Time": s, "GPUs": n}, ...] for one place."""
    if not isinstance(data, list) or not data or not all(isinstance(r, Mapping) for r in data):
        raise TraceError(f"{source}: expected a list of {{\"Time\": s, \"GPUs\": n}}; "
                         f"to fix: see the trace formats in docs/replay.md")
    if len(data) > MAX_POINTS:
        raise TraceError(f"{source}: {len(data):,} rows, more than {MAX_POINTS:,}; to fix: check the file (limits: "
                         f"docs/formats.md)")
    try:
        rows = sorted((_number(r["Time"], "Time"), _count(r["GPUs"], "GPUs")) for r in data)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(
            f'{source}: a row lacks Time or GPUs ({shown_text(str(e), 200)}); to fix: every row is '
            f'{{"Time": s, "GPUs": n}}'
        ) from None
    place = Place(zone=zone, gpu_type=gpu_type, market=market, cloud=cloud, gpus_per_node=gpus_per_node)
    price = _price(prices, zone, gpu_type, place.market, source)
    t0 = rows[0][0]
    pts = [TracePoint(at_s=t - t0, counts=(n,), usd_per_gpu_hour=(price,)) for t, n in rows]
    return Trace(name=source, places=(place,), points=_merge_equal(_last_per_time(pts)))


def _last_per_time(points: Sequence[TracePoint]) -> list[TracePoint]:
    by_t: dict[float, TracePoint] = {}
    for pt in points:
        by_t[pt.at_s] = pt
    return [by_t[t] for t in sorted(by_t)]


def parse_artifact_csv(text: str, *, market: Market, gpus_per_node: Callable[[str], int], prices: PriceLookup,
                       source: str = "trace", cloud: str = "gcp") -> Trace:
    """The artifact's `gpu_trace_*.csv`: Timestamp, then one `<gpu_type>_<zone>` column of GPU counts each."""
    rows = list(csv.reader(io.StringIO(text)))
    if len(rows) > MAX_POINTS + 1 or (rows and len(rows[0]) > MAX_PLACES + 1):
        raise TraceError(f"{source}: more than {MAX_POINTS:,} rows or {MAX_PLACES:,} columns; to fix: check the file "
                         f"(limits: docs/formats.md)")
    if len(rows) < 2 or "Timestamp" not in rows[0]:
        raise TraceError(f"{source}: expected a header with Timestamp and <gpu_type>_<zone> columns and at least "
                         f"one row; to fix: see the trace formats in docs/replay.md")
    head = rows[0]
    ti = head.index("Timestamp")
    cols = [(j, h) for j, h in enumerate(head) if j != ti and h.strip()]
    places = []
    for _, h in cols:
        gpu, sep, zone = h.partition("_")
        if not sep or not gpu or not zone:
            raise TraceError(
                f"{source}: column {shown(h)} is not <gpu_type>_<zone>; to fix: name it like A100-40_us-central1-a"
            )
        places.append(Place(zone=zone, gpu_type=gpu, market=market, cloud=cloud, gpus_per_node=gpus_per_node(gpu)))
    price = tuple(_price(prices, p.zone, p.gpu_type, p.market, source) for p in places)
    pts = []
    try:
        for r in rows[1:]:
            if not any(c.strip() for c in r):
                continue
            pts.append((_number(r[ti], "Timestamp"), tuple(_count(r[j], "a count") for j, _ in cols)))
    except (IndexError, ValueError) as e:
        raise TraceError(
            f"{source}: a row is not numbers ({shown_text(str(e), 200)}); to fix: one timestamp and one count per "
            f"column"
        ) from None
    pts.sort()
    t0 = pts[0][0]
    points = [TracePoint(at_s=t - t0, counts=c, usd_per_gpu_hour=price) for t, c in pts]
    return Trace(name=source, places=tuple(places), points=_merge_equal(_last_per_time(points)))


def _time_s(row: Mapping[str, str], t0: list[float], source: str, line: int) -> float:
    if (row.get("at_s") or "").strip():
        return _number(row["at_s"], f"line {line}: at_s")
    raw = (row.get("fetched_at") or "").strip()
    if not raw:
        raise TraceError(f"{source} line {line}: no at_s or fetched_at; to fix: give the time of each change")
    t = datetime.fromisoformat(raw.replace("Z", "+00:00")).timestamp()
    if not t0:
        t0.append(t)
    return t - t0[0]


def parse_changes_csv(text: str, *, gpus_per_node: Callable[[str], int], default_count: int | None = None,
                      source: str = "trace") -> Trace:
    """Ours (sparse changes) or the store's price history; see the module docstring."""
    reader = csv.DictReader(io.StringIO(text))
    fields = set(reader.fieldnames or ())
    need = {"zone", "gpu_type", "usd_per_gpu_hour"}
    if not need <= fields or not ({"at_s", "fetched_at"} & fields):
        raise TraceError(f"{source}: a changes CSV needs columns at_s (or fetched_at), zone, gpu_type, [market], "
                         f"[count], usd_per_gpu_hour; got {sorted(fields)}; to fix: see docs/replay.md")
    if "count" not in fields and default_count is None:
        raise TraceError(f"{source}: the trace has prices but no count column; to fix: say how many GPUs each place "
                         f"offers (--trace-gpus N)")
    changes: list[tuple[float, int, tuple[str, str, Market], dict[str, str]]] = []
    places: dict[tuple[str, str, Market], Place] = {}
    t0: list[float] = []
    rows = list(reader)
    if len(rows) > MAX_POINTS * 4:
        raise TraceError(f"{source}: {len(rows):,} rows, more than {MAX_POINTS * 4:,}; to fix: check the file "
                         f"(limits: docs/formats.md)")
    try:
        # The store's history is sorted by key, not time: find the earliest time first.
        if "fetched_at" in fields and "at_s" not in fields:
            stamps = [datetime.fromisoformat(r["fetched_at"].strip().replace("Z", "+00:00")).timestamp()
                      for r in rows if (r.get("fetched_at") or "").strip()]
            t0.append(min(stamps) if stamps else 0.0)
        for n, r in enumerate(rows, start=2):
            market = Market.parse((r.get("market") or "on-demand").strip())
            key = (r["zone"].strip(), r["gpu_type"].strip(), market)
            if key not in places:
                places[key] = Place(zone=key[0], gpu_type=key[1], market=market,
                                    cloud=(r.get("cloud") or "gcp").strip() or "gcp",
                                    region=(r.get("region") or "").strip(), gpus_per_node=gpus_per_node(key[1]))
            changes.append((_time_s(r, t0, source, n), n, key, r))
    except (ValueError, ValidationError) as e:
        raise TraceError(f"{source}: {shown_text(str(e), 300)}; to fix: see the changes CSV format in docs/replay.md") \
            from None
    if not changes:
        raise TraceError(f"{source}: no rows; to fix: give at least the state at time 0")
    order = list(places)
    count: dict[tuple[str, str, Market], int] = {k: int(default_count or 0) for k in order}
    price: dict[tuple[str, str, Market], float | None] = {k: None for k in order}
    points: list[TracePoint] = []
    changes.sort(key=lambda c: (c[0], c[1]))
    i = 0
    while i < len(changes):
        t = changes[i][0]
        while i < len(changes) and changes[i][0] == t:
            _, n, key, r = changes[i]
            try:
                if (r.get("count") or "").strip():
                    count[key] = _count(r["count"], "count")
                if (r.get("usd_per_gpu_hour") or "").strip():
                    price[key] = _number(r["usd_per_gpu_hour"], "usd_per_gpu_hour")
            except ValueError as e:
                raise TraceError(f"{source} line {n}: {shown_text(str(e), 200)}; to fix: counts and prices are "
                                 f"numbers") from None
            i += 1
        if any(price[k] is None for k in order):
            continue  # a place is known but not yet priced: the trace starts once every place has a price
        try:
            points.append(TracePoint(at_s=t, counts=tuple(count[k] for k in order),
                                     usd_per_gpu_hour=tuple(float(price[k] or 0.0) for k in order)))
        except ValidationError as e:
            raise TraceError(f"{source}: {e}; to fix: correct the file") from None
    if not points:
        missing = [k for k in order if price[k] is None]
        raise TraceError(f"{source}: place {missing[0][1]}@{missing[0][0]} never gets a price; "
                         f"to fix: give usd_per_gpu_hour in its first row")
    start = points[0].at_s
    shifted = [TracePoint(at_s=p.at_s - start, counts=p.counts, usd_per_gpu_hour=p.usd_per_gpu_hour) for p in points]
    return Trace(name=source, places=tuple(places[k] for k in order), points=_merge_equal(shifted))


@dataclass(frozen=True, kw_only=True)
class TraceReading:
    """How to read traces that lack a field: the artifact's (one place for its JSON traces, a market,
    prices) and price-only histories (GPUs per place)."""

    prices: PriceLookup
    gpus_per_node: Callable[[str], int]
    zone: str = "us-central1-a"
    gpu_type: str = "A100-40"
    market: Market = Market.ON_DEMAND
    default_count: int | None = None


def read_trace(source: str, text: str, how: TraceReading) -> Trace:
    """Any trace format from its text, told apart by `source`'s suffix and the text's shape (pure). JSON is read
    with sailor_core/files.py's bounds (no NaN, infinities, duplicate keys or deep nesting)."""
    try:
        if source.endswith(".json"):
            data = parse_json(text, source=source, error=TraceError)
            if isinstance(data, list):
                return parse_artifact_json(data, zone=how.zone, gpu_type=how.gpu_type, market=how.market,
                                           gpus_per_node=how.gpus_per_node(how.gpu_type), prices=how.prices,
                                           source=source)
            return parse_sailor_trace(data, source=source)
        head = text.splitlines()[0] if text else ""
        if "Timestamp" in head.split(","):
            return parse_artifact_csv(text, market=how.market, gpus_per_node=how.gpus_per_node, prices=how.prices,
                                      source=source)
        return parse_changes_csv(text, gpus_per_node=how.gpus_per_node, default_count=how.default_count,
                                 source=source)
    except ValidationError as e:
        raise TraceError(f"{source}: {shown_text(str(e), 300)}; to fix: see the trace formats in docs/replay.md") \
            from None
