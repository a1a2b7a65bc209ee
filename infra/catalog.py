"""Price catalogs: a SkyPilot-format CSV importer, price quotes, and pure price queries over a table.

Contract:
- `load_skypilot_csv(text, cloud=...)` parses a catalog in SkyPilot's published `vms.csv` format
  by column name (InstanceType, AcceleratorName, AcceleratorCount, vCPUs, MemoryGiB, Price,
  SpotPrice, Region, AvailabilityZone; extra columns are ignored, a missing required column is an
  error naming it). It keeps every sound row and returns, next to them, each rejected row with its
  line number and the reason: blank required fields, exact or conflicting duplicates, and
  placeholder (zero or sentinel), negative or NaN prices. A row whose spot price alone is bad keeps
  its on-demand price and loses only the spot market (reported too).
- `CatalogTable` is an immutable table; the query functions (`vm_price`, `accelerator_price`,
  `catalog_shapes`, `cheapest`) are pure functions of the table and their arguments.
- `PriceQuote` is one price of one VM shape in one zone on one market, with its fetch time and
  source; `PriceSource` is the protocol that live price feeds (infra/aws, infra/gcp) and
  `CatalogPriceSource` implement, so providers take any of them and tests inject their own.
GPU names are mapped to the project's names (`A100-40`, `V100-16`, `H100-80`, ...).
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, runtime_checkable

from sailor_core.domain import Market, default_region
from sailor_core.errors import SailorError

# SkyPilot accelerator names -> the project's GPU type names (model-memoryGB, as sailor_core.catalog).
SKYPILOT_GPU_NAMES: dict[str, str] = {
    "V100": "V100-16",
    "V100-32GB": "V100-32",
    "A100": "A100-40",
    "A100-80GB": "A100-80",
    "H100": "H100-80",
    "H100-MEGA": "H100-80",
    "H200": "H200-141",
    "L4": "L4-24",
    "T4": "T4-16",
    "A10G": "A10G-24",
    "A10": "A10-24",
    "L40S": "L40S-48",
    "P100": "P100-16",
    "K80": "K80-12",
}

REQUIRED_COLUMNS = ("InstanceType", "AcceleratorName", "AcceleratorCount", "Price", "SpotPrice", "Region",
                    "AvailabilityZone")
# Prices that catalogs use to mean "unknown" rather than a real hourly price.
PLACEHOLDER_PRICES_USD = frozenset({0.0, 999.0, 9999.0, 99999.0, 999999.0})


def canonical_gpu_name(name: str) -> str:
    """The project's GPU type for a SkyPilot accelerator name; unknown names pass through unchanged."""
    return SKYPILOT_GPU_NAMES.get(name.strip(), name.strip())


@dataclass(frozen=True, kw_only=True)
class CatalogRow:
    """One VM shape (or, with an empty instance type, one attachable GPU) in one zone, per hour."""

    cloud: str
    instance_type: str
    gpu_type: str  # project name, "" for a CPU-only shape
    gpu_count: float
    vcpus: float | None
    memory_gib: float | None
    region: str
    zone: str
    on_demand_usd_per_hour: float | None
    spot_usd_per_hour: float | None

    def price(self, market: Market) -> float | None:
        return self.spot_usd_per_hour if market is Market.SPOT else self.on_demand_usd_per_hour


@dataclass(frozen=True, kw_only=True)
class RejectedRow:
    line: int  # 1-based line in the file, the header being line 1
    reason: str
    raw: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class CatalogTable:
    cloud: str
    rows: tuple[CatalogRow, ...]
    rejected: tuple[RejectedRow, ...] = ()
    fetched_at: datetime | None = None
    source: str = ""

    def report(self) -> str:
        """A human summary of what was kept and what was rejected and why."""
        lines = [f"{self.source or self.cloud}: kept {len(self.rows)} rows, rejected {len(self.rejected)}"]
        lines += [f"  line {r.line}: {r.reason}" for r in self.rejected]
        return "\n".join(lines)


def _price(raw: str, column: str) -> tuple[float | None, str]:
    """(price, problem): None and "" for a blank, None and the reason for a bad value."""
    text = raw.strip()
    if not text:
        return None, ""
    try:
        value = float(text)
    except ValueError:
        return None, f"{column}={text!r} is not a number"
    if math.isnan(value) or math.isinf(value):
        return None, f"{column}={text} is not a finite price"
    if value < 0:
        return None, f"{column}={text} is negative"
    if value in PLACEHOLDER_PRICES_USD:
        return None, f"{column}={text} is a placeholder, not a price"
    return value, ""


def _number(raw: str) -> float | None:
    try:
        v = float(raw)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def load_skypilot_csv(text: str, *, cloud: str, source: str = "", fetched_at: datetime | None = None) -> CatalogTable:
    """Parse a SkyPilot-format catalog, keeping sound rows and reporting each rejected one."""
    reader = csv.DictReader(io.StringIO(text))
    header = [h.strip() for h in (reader.fieldnames or [])]
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise SailorError(
            f"catalog {source or cloud}: missing column(s) {missing}; found {header}; "
            f"to fix: use SkyPilot's vms.csv format (columns {', '.join(REQUIRED_COLUMNS)})"
        )
    kept: list[tuple[int, CatalogRow]] = []
    rejected: list[RejectedRow] = []
    for i, rec in enumerate(reader, start=2):
        raw = {(k or "").strip(): (v or "").strip() for k, v in rec.items() if k is not None}
        blanks = [c for c in ("Region", "AvailabilityZone") if not raw.get(c)]
        if not raw.get("InstanceType") and not raw.get("AcceleratorName"):
            blanks.insert(0, "InstanceType and AcceleratorName")
        if blanks:
            rejected.append(RejectedRow(line=i, reason=f"blank {', '.join(blanks)}", raw=raw))
            continue
        gpu_name = raw.get("AcceleratorName", "")
        count = _number(raw.get("AcceleratorCount", "")) if gpu_name else 0.0
        if gpu_name and (count is None or count <= 0):
            rejected.append(RejectedRow(line=i, reason=f"AcceleratorCount={raw.get('AcceleratorCount')!r} "
                                                        f"is not a positive number", raw=raw))
            continue
        od, od_problem = _price(raw.get("Price", ""), "Price")
        spot, spot_problem = _price(raw.get("SpotPrice", ""), "SpotPrice")
        if od is None and spot is None:
            why = "; ".join(p for p in (od_problem, spot_problem) if p) or "blank Price and SpotPrice"
            rejected.append(RejectedRow(line=i, reason=why, raw=raw))
            continue
        if od_problem or spot_problem:
            # The row stays for the market whose price is sound; say which market was dropped.
            rejected.append(RejectedRow(
                line=i, reason=f"{od_problem or spot_problem} (kept the row for its other market only)", raw=raw))
        kept.append((i, CatalogRow(
            cloud=cloud, instance_type=raw.get("InstanceType", ""),
            gpu_type=canonical_gpu_name(gpu_name) if gpu_name else "", gpu_count=float(count or 0.0),
            vcpus=_number(raw.get("vCPUs", "")), memory_gib=_number(raw.get("MemoryGiB", "")),
            region=raw["Region"], zone=raw["AvailabilityZone"],
            on_demand_usd_per_hour=od, spot_usd_per_hour=spot,
        )))
    # Duplicates: same shape in the same zone. Identical copies keep the first; conflicting prices
    # leave no way to know which is right, so every copy goes.
    by_key: dict[tuple[str, str, str, str], list[tuple[int, CatalogRow]]] = {}
    for line, row in kept:
        by_key.setdefault((row.instance_type, row.gpu_type, row.region, row.zone), []).append((line, row))
    rows: list[CatalogRow] = []
    for key, group in by_key.items():
        first_line, first = group[0]
        conflicting = any(r != first for _, r in group[1:])
        if conflicting:
            lines = [ln for ln, _ in group]
            for ln, _ in group:
                rejected.append(RejectedRow(line=ln, reason=f"conflicting duplicate of {key[0] or key[1]} in "
                                                            f"{key[3]} (lines {lines})"))
            continue
        rows.append(first)
        for ln, _ in group[1:]:
            rejected.append(RejectedRow(line=ln, reason=f"duplicate of line {first_line} "
                                                        f"({key[0] or key[1]} in {key[3]})"))
    rejected.sort(key=lambda r: r.line)
    return CatalogTable(cloud=cloud, rows=tuple(rows), rejected=tuple(rejected),
                        fetched_at=fetched_at, source=source)


def load_skypilot_file(path: str | Path, *, cloud: str, fetched_at: datetime | None = None) -> CatalogTable:
    p = Path(path)
    if not p.is_file():
        raise SailorError(f"catalog file {p} not found; to fix: pass the path of a SkyPilot vms.csv")
    when = fetched_at or datetime.fromtimestamp(p.stat().st_mtime, UTC)
    return load_skypilot_csv(p.read_text(), cloud=cloud, source=str(p), fetched_at=when)


# ---------------------------------------------------------------------------------------------
# Pure queries


def vm_price(table: CatalogTable, *, instance_type: str, zone: str, market: Market) -> float | None:
    """Hourly price of one VM of `instance_type` in `zone` on `market`, None if the catalog lacks it."""
    for row in table.rows:
        if row.instance_type == instance_type and row.zone == zone:
            return row.price(market)
    return None


def accelerator_price(table: CatalogTable, *, gpu_type: str, zone: str, market: Market) -> float | None:
    """Hourly price of ONE attachable GPU (GCP N1 style rows with an empty instance type)."""
    for row in table.rows:
        if not row.instance_type and row.gpu_type == gpu_type and row.zone == zone:
            p = row.price(market)
            return None if p is None else p / max(row.gpu_count, 1.0)
    return None


@dataclass(frozen=True, kw_only=True)
class CatalogShape:
    """One VM shape a catalog prices: `usd_per_hour` per VM of `gpus_per_vm` GPUs on `market`.

    A price, not capacity: a catalog does not say how many VMs are free. What can be rented now is a
    provider's offering, a `Capacity` (sailor_core/domain.py)."""

    cloud: str
    instance_type: str
    gpu_type: str
    gpus_per_vm: int
    region: str
    zone: str
    market: Market
    usd_per_hour: float

    @property
    def usd_per_gpu_hour(self) -> float:
        return self.usd_per_hour / self.gpus_per_vm


def catalog_shapes(
    table: CatalogTable, *, regions: Sequence[str] | None = None, gpu_types: Sequence[str] | None = None,
    markets: Sequence[Market] | None = None,
) -> list[CatalogShape]:
    """GPU VM shapes with a price, filtered; sorted by price per GPU-hour, then zone and type."""
    mk = list(markets) if markets else list(Market)
    out = []
    for row in table.rows:
        if not row.instance_type or not row.gpu_type or row.gpu_count < 1:
            continue
        if regions and row.region not in regions:
            continue
        if gpu_types and row.gpu_type not in gpu_types:
            continue
        for m in mk:
            p = row.price(m)
            if p is not None:
                out.append(CatalogShape(cloud=row.cloud, instance_type=row.instance_type, gpu_type=row.gpu_type,
                                        gpus_per_vm=int(row.gpu_count), region=row.region, zone=row.zone,
                                        market=m, usd_per_hour=p))
    out.sort(key=lambda o: (o.usd_per_gpu_hour, o.zone, o.instance_type, o.market.value))
    return out


def cheapest(shapes: Iterable[CatalogShape], *, gpu_type: str, market: Market) -> CatalogShape | None:
    best = [o for o in shapes if o.gpu_type == gpu_type and o.market is market]
    return min(best, key=lambda o: (o.usd_per_gpu_hour, o.zone, o.instance_type), default=None)


# ---------------------------------------------------------------------------------------------
# Price quotes and sources


@dataclass(frozen=True, kw_only=True)
class PriceQuote:
    """The hourly price of one VM of `instance_type` in `zone` (or a whole region if zone is "")."""

    cloud: str
    instance_type: str
    region: str
    zone: str
    market: Market
    usd_per_hour: float
    fetched_at: datetime
    source: str

    def __post_init__(self) -> None:
        if not (self.usd_per_hour >= 0 and math.isfinite(self.usd_per_hour)):
            raise SailorError(f"price of {self.instance_type}@{self.zone or self.region} from {self.source} "
                              f"is {self.usd_per_hour}; to fix: check the price source")


@runtime_checkable
class PriceSource(Protocol):
    """Anything that quotes hourly VM prices: a live API feed, a catalog, a test's scripted feed."""

    def quotes(
        self, *, instance_types: Sequence[str], regions: Sequence[str], markets: Sequence[Market],
    ) -> list[PriceQuote]: ...


def lookup(quotes: Iterable[PriceQuote], *, instance_type: str, zone: str, market: Market) -> PriceQuote | None:
    """The quote for a zone; a region-wide quote (zone "") applies to every zone of its region."""
    regional = None
    for q in quotes:
        if q.instance_type != instance_type or q.market is not market:
            continue
        if q.zone == zone:
            return q
        if not q.zone and zone.startswith(q.region):
            regional = q
    return regional


@dataclass
class CatalogPriceSource:
    """Quotes from a catalog table (the offline fallback, or a pinned price list)."""

    table: CatalogTable
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))

    def quotes(
        self, *, instance_types: Sequence[str], regions: Sequence[str], markets: Sequence[Market],
    ) -> list[PriceQuote]:
        when = self.table.fetched_at or self.clock()
        out = []
        for row in self.table.rows:
            if row.instance_type not in instance_types or (regions and row.region not in regions):
                continue
            for m in markets:
                p = row.price(m)
                if p is not None:
                    out.append(PriceQuote(cloud=row.cloud, instance_type=row.instance_type, region=row.region,
                                          zone=row.zone, market=m, usd_per_hour=p, fetched_at=when,
                                          source=f"catalog:{self.table.source or self.table.cloud}"))
        return out


@dataclass
class ChainedPriceSource:
    """The first source that quotes a (type, zone, market) wins; later ones fill the gaps.

    A failing live source does not hide the catalog: its error is kept in `errors` and the next
    source is asked.
    """

    sources: Sequence[PriceSource]
    errors: list[str] = field(default_factory=list)

    def quotes(
        self, *, instance_types: Sequence[str], regions: Sequence[str], markets: Sequence[Market],
    ) -> list[PriceQuote]:
        seen: set[tuple[str, str, str, Market]] = set()
        out: list[PriceQuote] = []
        for src in self.sources:
            try:
                got = src.quotes(instance_types=instance_types, regions=regions, markets=markets)
            except Exception as e:  # a live feed down must not stop pricing from the catalog
                self.errors.append(f"{type(src).__name__}: {e}")
                continue
            for q in got:
                key = (q.instance_type, q.region, q.zone, q.market)
                if key not in seen:
                    seen.add(key)
                    out.append(q)
        return out


@dataclass
class ScriptedPriceSource:
    """A price feed whose prices the caller sets (tests, scenario files): `set(...)` then `quotes(...)`."""

    cloud: str
    clock: Callable[[], datetime] = field(default=lambda: datetime.now(UTC))
    prices: dict[tuple[str, str, Market], float] = field(default_factory=dict)

    def set(self, *, instance_type: str, zone: str, market: Market, usd_per_hour: float) -> None:
        self.prices[(instance_type, zone, Market.parse(market))] = usd_per_hour

    def quotes(
        self, *, instance_types: Sequence[str], regions: Sequence[str], markets: Sequence[Market],
    ) -> list[PriceQuote]:
        now = self.clock()
        return [
            PriceQuote(cloud=self.cloud, instance_type=t, region=default_region(z), zone=z, market=m,
                       usd_per_hour=p, fetched_at=now, source="scripted")
            for (t, z, m), p in sorted(self.prices.items())
            if t in instance_types and m in markets and (not regions or default_region(z) in regions)
        ]
