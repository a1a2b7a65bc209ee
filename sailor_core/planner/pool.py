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

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sailor_core.domain import Capacity, Market, ResourcePool, default_region
from sailor_core.errors import PoolFileError, SailorError, ValidationError
from sailor_core.profiles import ProfileBook

_ENTRY_KEYS = {"count", "market", "usd_per_gpu_hour", "gpus_per_vm", "preemptions_per_vm_hour"}
_OLD_KEYS = {"gpus_per_node": "gpus_per_vm"}  # older name -> the name it reads as


def load_pool_file(path: str | os.PathLike[str], book: ProfileBook) -> ResourcePool:
    return parse_pool(read_pool_document(path), book, source=str(path))


def read_pool_document(path: str | os.PathLike[str]) -> Any:
    """The pool file's content (YAML or JSON), unparsed: for `parse_pool` and `parse_preemption_rates`."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise PoolFileError(f"pool file {path} does not exist; to fix: check the path (see docs/planner.md)") from None
    data: Any
    if str(path).endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PoolFileError(f"pool file {path} is not valid JSON: {e}; to fix: correct it there "
                                f"(format in docs/planner.md)") from None
    else:
        import yaml  # YAML is a superset of JSON: one parser covers both

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise PoolFileError(f"pool file {path} is not valid YAML: {yaml_problem(e)}; to fix: correct it there "
                                f"(format in docs/planner.md)") from None
    return data


def yaml_problem(e: Exception) -> str:
    """PyYAML's multi-line message as one line: where, then what."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(getattr(e, "problem", None) or e).split())


def parse_pool(data: Any, book: ProfileBook, *, source: str = "pool") -> ResourcePool:
    errors: list[str] = []
    entries: list[Capacity] = []
    if not isinstance(data, Mapping) or not isinstance(data.get("zones"), Mapping) or not data["zones"]:
        raise PoolFileError(
            f"{source}: expected a mapping with a non-empty 'zones:' mapping of zone name -> {{gpus: ...}}; "
            f"to fix: see the pool file format in docs/planner.md"
        )
    if "preemptions_per_vm_hour" in data:
        _rate(data["preemptions_per_vm_hour"], "preemptions_per_vm_hour", errors)
    for zone, zspec in data["zones"].items():
        zone = str(zone)
        where = f"zones.{zone}"
        if not isinstance(zspec, Mapping) or not isinstance(zspec.get("gpus"), Mapping):
            errors.append(f"{where}: needs a 'gpus:' mapping of GPU type -> {{count: N}}")
            continue
        unknown = set(zspec) - {"gpus", "region", "cloud"}
        if unknown:
            errors.append(f"{where}: unknown keys {sorted(unknown)} (allowed: gpus, region, cloud)")
        region = str(zspec.get("region") or default_region(zone))
        cloud = str(zspec.get("cloud") or "gcp")
        for gpu, spec in zspec["gpus"].items():
            gpu = str(gpu)
            items = spec if isinstance(spec, list) else [spec]
            for i, item in enumerate(items):
                w = f"{where}.gpus.{gpu}" + (f"[{i}]" if isinstance(spec, list) else "")
                e = _entry(item, zone=zone, region=region, cloud=cloud, gpu=gpu, book=book, where=w, errors=errors)
                if e is not None:
                    entries.append(e)
    keys = [(e.zone, e.gpu_type, e.market) for e in entries]
    for k in sorted({k for k in keys if keys.count(k) > 1}):
        errors.append(f"zones.{k[0]}.gpus.{k[1]}: market {k[2].value} listed twice; merge the counts")
    if errors:
        raise PoolFileError(f"{source}: " + "; ".join(errors) + " (pool file format: docs/planner.md)")
    return ResourcePool(entries=tuple(entries))


def _entry(
    item: Any, *, zone: str, region: str, cloud: str, gpu: str, book: ProfileBook, where: str, errors: list[str]
) -> Capacity | None:
    if isinstance(item, int) and not isinstance(item, bool):
        item = {"count": item}
    if not isinstance(item, Mapping):
        errors.append(f"{where}: expected {{count: N, ...}}, got {item!r}")
        return None
    item = _renamed(item, where, errors)
    unknown = set(item) - _ENTRY_KEYS
    if unknown:
        errors.append(f"{where}: unknown keys {sorted(unknown)} (allowed: {', '.join(sorted(_ENTRY_KEYS))})")
    count = item.get("count")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        errors.append(f"{where}.count: must be a whole number >= 0, got {count!r}")
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
                f"{where}: GPU type {gpu!r} is not in the store (known: {sorted(book.gpu_types)}); "
                f"to fix: use a known name or give gpus_per_vm and profile it"
            )
            return None
        gpn = known.gpus_per_node
    if not isinstance(gpn, int) or isinstance(gpn, bool) or gpn < 1:
        errors.append(f"{where}.gpus_per_vm: must be a whole number >= 1, got {gpn!r}")
        return None
    if "preemptions_per_vm_hour" in item:
        _rate(item["preemptions_per_vm_hour"], f"{where}.preemptions_per_vm_hour", errors)
        if market is not Market.SPOT:
            errors.append(f"{where}.preemptions_per_vm_hour: only spot capacity is preempted; to fix: add "
                          f"market: spot or drop the rate")
    price = item.get("usd_per_gpu_hour")
    if price is None:
        price = book.price_usd_per_gpu_hour(zone, gpu, market)
        if price is None:
            errors.append(
                f"{where}: no {market.value} price for {gpu} in {zone} in the store; "
                f"to fix: add usd_per_gpu_hour to this entry or import prices (sailor profiles import-prices)"
            )
            return None
    try:
        price = float(price)
        return Capacity(
            zone=zone, region=region, gpu_type=gpu, gpus=count, market=market, gpus_per_vm=gpn,
            usd_per_gpu_hour=price, cloud=cloud,
        )
    except (TypeError, ValueError, ValidationError) as e:
        errors.append(f"{where}: {e}")
        return None


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
    if isinstance(v, bool) or not isinstance(v, int | float) or not (v >= 0 and math.isfinite(v)):
        errors.append(f"{where}: must be a number >= 0 (preemptions per VM-hour), got {v!r}")
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
