"""Pool files: the GPUs a user can rent, by zone, type and market, parsed into a `ResourcePool`.

Contract: `parse_pool(data, book)` turns the documented mapping (docs/planner.md) into a
`ResourcePool`; `load_pool_file(path, book)` reads it from YAML or JSON first. Prices and GPUs per
node left out of the file default from the profile book (the store's price table and GPU
catalog). Every problem in the file is reported at once, with the path to the bad value and how
to fix it. `apply_what_if` applies one "what if" variation to a pool. Pure except for reading the
one file named.

An entry's `count` is GPUs (`Capacity.gpus`), never VMs; `gpus_per_vm` is the GPUs of one VM
(`gpus_per_node`, its older name, is still read; `pool_to_dict` writes `gpus_per_vm`).

    zones:
      us-central1-a:
        gpus:
          A100-40: {count: 128}
          V100-16: {count: 384, market: spot, usd_per_gpu_hour: 0.9}
      us-west1-b:
        region: us-west1            # optional; default: zone name minus its last '-x'
        cloud: gcp                  # optional; default gcp
        gpus:
          A100-40:                  # a list: one entry per market
            - {count: 32, gpus_per_vm: 4, market: on-demand}
            - {count: 64, market: spot, preemptions_per_vm_hour: 0.2}
    preemptions_per_vm_hour: 0.05   # optional: spot entries without their own rate (default 0)
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sailor_core.domain import Capacity, Market, ResourcePool, default_region
from sailor_core.errors import PoolFileError, SailorError, ValidationError
from sailor_core.files import check_name, parse_json, parse_yaml, read_text, shown, shown_path
from sailor_core.profiles import ProfileBook

_ENTRY_KEYS = {"count", "market", "usd_per_gpu_hour", "gpus_per_vm", "preemptions_per_vm_hour"}
_OLD_KEYS = {"gpus_per_node": "gpus_per_vm"}  # older name -> the name it reads as

# Limits (docs/formats.md, "Limits"): what no real pool reaches, so that any file is read, checked and
# refused in bounded time and memory. The planner's own time still grows with zones and counts.
MAX_POOL_BYTES = 1 << 20  # a pool of every zone of three clouds, each with 8 GPU types, is ~300 KB
MAX_ZONES = 512  # all zones of AWS, GCP and Azure together are fewer than 400
MAX_GPU_TYPES = 64  # GPU types of one zone
MAX_ENTRIES = 4096  # (zone, GPU type, market) entries of the whole pool
MAX_GPUS = 100_000  # GPUs of one entry (the largest clusters hold about 100,000)
MAX_GPUS_PER_VM = 64  # the largest GPU VMs offered have 16
MAX_USD_PER_GPU_HOUR = 1000.0
MAX_PREEMPTIONS_PER_VM_HOUR = 3600.0  # one a second
MAX_PROBLEMS = 20  # problems a message lists (then how many more)


def load_pool_file(path: str | os.PathLike[str], book: ProfileBook) -> ResourcePool:
    return parse_pool(read_pool_document(path), book, source=str(path))


def read_pool_document(path: str | os.PathLike[str]) -> Any:
    """The pool file's content (YAML or JSON), unparsed: for `parse_pool` and `parse_preemption_rates`.
    Read within `MAX_POOL_BYTES`, without YAML aliases, duplicate keys or non-finite numbers
    (sailor_core/files.py); every problem is one `PoolFileError`."""
    text = read_text(path, max_bytes=MAX_POOL_BYTES, what="pool file", error=PoolFileError)
    source = f"pool file {shown_path(path)}"
    if str(path).endswith(".json"):
        return parse_json(text, source=source, error=PoolFileError)
    return parse_yaml(text, source=source, error=PoolFileError)  # YAML is a superset of JSON: it reads both


def parse_pool(data: Any, book: ProfileBook, *, source: str = "pool") -> ResourcePool:
    errors: list[str] = []
    entries: list[Capacity] = []
    if not isinstance(data, Mapping) or not isinstance(data.get("zones"), Mapping) or not data["zones"]:
        raise PoolFileError(
            f"{source}: expected a mapping with a non-empty 'zones:' mapping of zone name -> {{gpus: ...}}; "
            f"to fix: see the pool file format in docs/planner.md"
        )
    _check_sizes(data["zones"], source)
    if "preemptions_per_vm_hour" in data:
        _rate(data["preemptions_per_vm_hour"], "preemptions_per_vm_hour", errors)
    for zone_key, zspec in data["zones"].items():
        zone = check_name(zone_key, "zones: a zone", errors)
        if zone is not None:
            entries += _zone(zone, zspec, book, errors)
    counts = Counter((e.zone, e.gpu_type, e.market) for e in entries)
    for k in sorted(k for k, n in counts.items() if n > 1):
        errors.append(f"zones.{k[0]}.gpus.{k[1]}: market {k[2].value} listed twice; merge the counts")
    if errors:
        listed = errors[:MAX_PROBLEMS]
        more = f"; and {len(errors) - MAX_PROBLEMS} more problem(s)" if len(errors) > MAX_PROBLEMS else ""
        fix = "" if any("to fix:" in e for e in listed) else "; to fix: correct those entries"
        raise PoolFileError(f"{source}: " + "; ".join(listed) + more + " (pool file format: docs/planner.md)" + fix)
    return ResourcePool(entries=tuple(entries))


def _check_sizes(zones: Mapping[Any, Any], source: str) -> None:
    """Refuse a pool larger than the stated limits before any entry is looked at."""
    n_entries = 0
    for zspec in zones.values():
        gpus = zspec.get("gpus") if isinstance(zspec, Mapping) else None
        if isinstance(gpus, Mapping):
            if len(gpus) > MAX_GPU_TYPES:
                raise PoolFileError(f"{source}: a zone lists {len(gpus)} GPU types, more than {MAX_GPU_TYPES}; "
                                    f"to fix: check the file (limits: docs/formats.md)")
            n_entries += sum(len(v) if isinstance(v, list) else 1 for v in gpus.values())
    if len(zones) > MAX_ZONES or n_entries > MAX_ENTRIES:
        raise PoolFileError(f"{source}: {len(zones)} zones and {n_entries} entries, more than the {MAX_ZONES} zones "
                            f"and {MAX_ENTRIES} entries a pool may have; to fix: keep the zones you would rent in "
                            f"(limits: docs/formats.md)")


def _zone(zone: str, zspec: Any, book: ProfileBook, errors: list[str]) -> list[Capacity]:
    """The entries of one zone of the file."""
    where = f"zones.{zone}"
    if not isinstance(zspec, Mapping) or not isinstance(zspec.get("gpus"), Mapping):
        errors.append(f"{where}: needs a 'gpus:' mapping of GPU type -> {{count: N}}")
        return []
    unknown = set(zspec) - {"gpus", "region", "cloud"}
    if unknown:
        errors.append(f"{where}: unknown keys {shown(sorted(map(str, unknown)))} (allowed: gpus, region, cloud)")
    region = check_name(zspec["region"], f"{where}.region", errors) if zspec.get("region") else default_region(zone)
    cloud = check_name(zspec["cloud"], f"{where}.cloud", errors) if zspec.get("cloud") else "gcp"
    if region is None or cloud is None:
        return []
    out: list[Capacity] = []
    for gpu_key, spec in zspec["gpus"].items():
        gpu = check_name(gpu_key, f"{where}.gpus: a GPU type", errors)
        if gpu is None:
            continue
        items = spec if isinstance(spec, list) else [spec]
        for i, item in enumerate(items):
            w = f"{where}.gpus.{gpu}" + (f"[{i}]" if isinstance(spec, list) else "")
            e = _entry(item, zone=zone, region=region, cloud=cloud, gpu=gpu, book=book, where=w, errors=errors)
            if e is not None:
                out.append(e)
    return out


def _whole(v: Any, where: str, lo: int, hi: int, what: str, errors: list[str]) -> int | None:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        errors.append(f"{where}: must be a whole number from {lo} to {hi:,} ({what}), got {shown(v)}")
        return None
    return v


def _entry(
    item: Any, *, zone: str, region: str, cloud: str, gpu: str, book: ProfileBook, where: str, errors: list[str]
) -> Capacity | None:
    if isinstance(item, int) and not isinstance(item, bool):
        item = {"count": item}
    if not isinstance(item, Mapping):
        errors.append(f"{where}: expected {{count: N, ...}}, got {shown(item)}")
        return None
    item = _renamed(item, where, errors)
    unknown = set(item) - _ENTRY_KEYS
    if unknown:
        errors.append(f"{where}: unknown keys {shown(sorted(map(str, unknown)))} "
                      f"(allowed: {', '.join(sorted(_ENTRY_KEYS))})")
    count = _whole(item.get("count"), f"{where}.count", 0, MAX_GPUS, "GPUs", errors)
    if count is None:
        return None
    if not isinstance(item.get("market", "on-demand"), str):
        errors.append(f"{where}.market: must be spot or on-demand, got {shown(item['market'])}")
        return None
    try:
        market = Market.parse(item.get("market", "on-demand"))
    except ValidationError as e:
        errors.append(f"{where}.market: {e}")
        return None
    gpn = item.get("gpus_per_vm")
    if gpn is None:
        known = book.gpu_types.get(gpu)
        if known is None:
            errors.append(
                f"{where}: GPU type {gpu!r} is not in the store (known: {shown(sorted(book.gpu_types), 200)}); "
                f"to fix: use a known name or give gpus_per_vm and profile it"
            )
            return None
        gpn = known.gpus_per_node
    if _whole(gpn, f"{where}.gpus_per_vm", 1, MAX_GPUS_PER_VM, "GPUs of one VM", errors) is None:
        return None
    if "preemptions_per_vm_hour" in item:
        _rate(item["preemptions_per_vm_hour"], f"{where}.preemptions_per_vm_hour", errors)
        if market is not Market.SPOT:
            errors.append(f"{where}.preemptions_per_vm_hour: only spot capacity is preempted; to fix: add "
                          f"market: spot or drop the rate")
    price = _price(item, zone=zone, gpu=gpu, market=market, book=book, where=where, errors=errors)
    if price is None:
        return None
    try:
        return Capacity(
            zone=zone, region=region, gpu_type=gpu, gpus=count, market=market, gpus_per_vm=gpn,
            usd_per_gpu_hour=price, cloud=cloud,
        )
    except ValidationError as e:
        errors.append(f"{where}: {e}")
        return None


def _price(item: Mapping[str, Any], *, zone: str, gpu: str, market: Market, book: ProfileBook, where: str,
           errors: list[str]) -> float | None:
    """The entry's price: its own (a number from 0 to MAX_USD_PER_GPU_HOUR), else the store's."""
    price = item.get("usd_per_gpu_hour")
    if price is None:
        price = book.price_usd_per_gpu_hour(zone, gpu, market)
        if price is None:
            errors.append(
                f"{where}: no {market.value} price for {gpu} in {zone} in the store; "
                f"to fix: add usd_per_gpu_hour to this entry or import prices (sailor profiles import-prices)"
            )
            return None
    if isinstance(price, bool) or not isinstance(price, int | float) or not 0 <= price <= MAX_USD_PER_GPU_HOUR:
        errors.append(f"{where}.usd_per_gpu_hour: must be a number from 0 to {MAX_USD_PER_GPU_HOUR:g} (USD per "
                      f"GPU-hour), got {shown(price)}")
        return None
    return float(price)


def _renamed(item: Mapping[str, Any], where: str, errors: list[str]) -> Mapping[str, Any]:
    """The entry with older key names read as today's (a file written before the rename still loads)."""
    out = dict(item)
    for old, new in _OLD_KEYS.items():
        if old in out:
            if new in out:
                errors.append(f"{where}: give {new} or {old} (its older name), not both")
            out.setdefault(new, out[old])
            del out[old]
    return out


def _rate(v: Any, where: str, errors: list[str]) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= MAX_PREEMPTIONS_PER_VM_HOUR:
        errors.append(f"{where}: must be a number from 0 to {MAX_PREEMPTIONS_PER_VM_HOUR:g} (preemptions per "
                      f"VM-hour), got {shown(v)}")
        return None
    return float(v)


def parse_preemption_rates(data: Any) -> tuple[tuple[tuple[tuple[str, str], float], ...], float]:
    """The pool file's spot preemption rates: ((zone, GPU type) -> per VM-hour, ...) and the default
    for spot entries without one (top-level `preemptions_per_vm_hour`, else 0). Call after parse_pool
    (which reports malformed values)."""
    default = 0.0
    rates: list[tuple[tuple[str, str], float]] = []
    if not isinstance(data, Mapping):
        return (), default
    errors: list[str] = []
    if "preemptions_per_vm_hour" in data:
        default = _rate(data["preemptions_per_vm_hour"], "preemptions_per_vm_hour", errors) or 0.0
    for zone, zspec in (data.get("zones") or {}).items():
        gpus = zspec.get("gpus") if isinstance(zspec, Mapping) else None
        for gpu, spec in (gpus or {}).items():
            for item in spec if isinstance(spec, list) else [spec]:
                if isinstance(item, Mapping) and "preemptions_per_vm_hour" in item:
                    r = _rate(item["preemptions_per_vm_hour"], "", errors)
                    if r is not None:
                        rates.append(((str(zone), str(gpu)), r))
    return tuple(rates), default


def pool_to_dict(pool: ResourcePool) -> dict[str, Any]:
    """The pool in the file format (every default made explicit)."""
    zones: dict[str, Any] = {}
    for e in pool.entries:
        z = zones.setdefault(e.zone, {"region": e.region, "cloud": e.cloud, "gpus": {}})
        z["gpus"].setdefault(e.gpu_type, []).append(
            {"count": e.gpus, "market": e.market.value, "gpus_per_vm": e.gpus_per_vm,
             "usd_per_gpu_hour": e.usd_per_gpu_hour}
        )
    return {"zones": zones}


# --- what-if variations ------------------------------------------------------------------------

_ADD = re.compile(
    r"^\s*([+-])\s*(\d+)\s+(\S+?)(?:\s+(spot|on-demand))?\s+in\s+(\S+)\s*$", re.IGNORECASE
)
_PRICE = re.compile(
    r"^\s*(\S+?)(?:\s+(spot|on-demand))?\s+price\s*([+-]\s*\d+(?:\.\d+)?)\s*%\s*(?:in\s+(\S+)\s*)?$", re.IGNORECASE
)

WHAT_IF_HELP = (
    "'+16 V100-16 in us-west1-b', '-32 A100-40 spot in us-central1-a', "
    "'A100-40 spot price +30%', 'V100-16 price -10% in us-central1-a'"
)


def apply_what_if(pool: ResourcePool, change: str, book: ProfileBook) -> ResourcePool:
    """The pool after one variation: add/remove GPUs in a zone, or scale a GPU type's price."""
    m = _ADD.match(change)
    if m:
        sign, n, gpu, market_s, zone = m.groups()
        market = Market.parse(market_s or "on-demand")
        delta = int(n) * (1 if sign == "+" else -1)
        entries = list(pool.entries)
        for i, e in enumerate(entries):
            if (e.zone, e.gpu_type, e.market) == (zone, gpu, market):
                if e.gpus + delta > MAX_GPUS:
                    raise SailorError(f"what-if {shown(change)}: {e.gpus + delta:,} GPUs of one entry is more than "
                                      f"{MAX_GPUS:,}; to fix: add fewer (limits: docs/formats.md)")
                entries[i] = replace(e, gpus=max(0, e.gpus + delta))
                return ResourcePool(entries=tuple(entries))
        if delta < 0:
            raise SailorError(f"what-if {change!r}: the pool has no {market.value} {gpu} in {zone} to remove")
        zspec: dict[str, Any] = {"gpus": {gpu: {"count": delta, "market": market.value}}}
        same_zone = [e for e in pool.entries if e.zone == zone]
        if same_zone:
            zspec["region"] = same_zone[0].region
            zspec["cloud"] = same_zone[0].cloud
        template = {"zones": {zone: zspec}}
        added = parse_pool(template, book, source=f"what-if {change!r}")
        return ResourcePool(entries=tuple(entries) + added.entries)
    m = _PRICE.match(change)
    if m:
        gpu, market_s, pct, zone = m.groups()
        factor = 1 + float(pct.replace(" ", "")) / 100
        if factor < 0:
            raise SailorError(f"what-if {change!r}: a price cannot fall by more than 100%")
        only: Market | None = Market.parse(market_s) if market_s else None
        hit = False
        entries = []
        for e in pool.entries:
            # "A100" names the family: every A100-* type in the pool
            named = e.gpu_type == gpu or e.gpu_type.startswith(gpu + "-")
            if named and (only is None or e.market == only) and (zone is None or e.zone == zone):
                e = replace(e, usd_per_gpu_hour=e.usd_per_gpu_hour * factor)
                hit = True
            entries.append(e)
        if not hit:
            raise SailorError(f"what-if {change!r}: no pool entry matches; the pool has {sorted(pool.gpu_types)}")
        return ResourcePool(entries=tuple(entries))
    raise SailorError(f"cannot read what-if {change!r}; to fix: write it like {WHAT_IF_HELP}")
