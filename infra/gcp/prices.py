"""GCP price feeds behind infra.catalog.PriceSource: the Cloud Billing catalog and SkyPilot's CSV.

Contract:
- `BillingCatalogSource(fetch_skus)` prices GCE GPU shapes from Cloud Billing catalog SKUs (service
  Compute Engine): per region and market (usageType OnDemand or Preemptible, which is also spot),
  a shape costs vcpus x core-hour + memory x GiB-hour of its machine family + gpus x GPU-hour.
  `fetch_skus()` returns the SKU dicts as the API's `services/{id}/skus` pages list them (the
  default fetcher, `billing_fetcher`, pages through the API with google-auth's standard chain).
  A shape with any component unpriced is not quoted. Quotes are region-wide (zone "").
- `SkypilotGcpPriceSource(table)` does the same from a SkyPilot GCP catalog: accelerator-optimised
  types by their row, N1 shapes as host row + attached-GPU rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from infra.catalog import CatalogTable, PriceQuote, accelerator_price, vm_price
from infra.gcp.machine_types import SHAPES, GceShape
from sailor_core.domain import Market

COMPUTE_SERVICE_ID = "6F81-5844-456A"  # Compute Engine in the Cloud Billing catalog

_FAMILY = {"N1 Predefined": "n1", "N2": "n2", "A2": "a2", "A3": "a3", "G2": "g2"}
_GPU = {"Tesla V100": "nvidia-tesla-v100", "Tesla T4": "nvidia-tesla-t4", "Tesla A100": "nvidia-tesla-a100",
        "A100 80GB": "nvidia-a100-80gb", "H100 80GB": "nvidia-h100-80gb", "L4": "nvidia-l4"}
_MACHINE_RE = re.compile(r"^(?:Spot Preemptible )?(N1 Predefined|N2|A2|A3|G2) Instance (Core|Ram)\b")
_GPU_RE = re.compile(r"^(?:Spot Preemptible )?Nvidia (Tesla V100|Tesla T4|Tesla A100|A100 80GB|H100 80GB|L4) GPU\b")


def _now() -> datetime:
    return datetime.now(UTC)


def unit_price_usd(sku: dict[str, Any]) -> float | None:
    try:
        rate = sku["pricingInfo"][0]["pricingExpression"]["tieredRates"][-1]["unitPrice"]
    except (KeyError, IndexError):
        return None
    if rate.get("currencyCode", "USD") != "USD":
        return None
    return int(rate.get("units", 0) or 0) + int(rate.get("nanos", 0) or 0) / 1e9


def parse_skus(skus: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str, Market], float]:
    """(family or 'gpu', resource, region, market) -> USD per unit-hour (core, GiB or GPU)."""
    out: dict[tuple[str, str, str, Market], float] = {}
    for sku in skus:
        desc = sku.get("description", "")
        usage = sku.get("category", {}).get("usageType", "")
        if usage not in ("OnDemand", "Preemptible"):
            continue  # commitments and the like
        market = Market.SPOT if usage == "Preemptible" else Market.ON_DEMAND
        price = unit_price_usd(sku)
        if price is None or price <= 0:
            continue
        if m := _MACHINE_RE.match(desc):
            key = (_FAMILY[m.group(1)], m.group(2).lower())
        elif g := _GPU_RE.match(desc):
            key = ("gpu", _GPU[g.group(1)])
        else:
            continue
        for region in sku.get("serviceRegions", []):
            out.setdefault((key[0], key[1], region, market), price)
    return out


def shape_price(table: dict[tuple[str, str, str, Market], float], shape: GceShape, region: str,
                market: Market) -> float | None:
    core = table.get((shape.family, "core", region, market))
    ram = table.get((shape.family, "ram", region, market))
    gpu = table.get(("gpu", shape.accelerator, region, market)) if shape.accelerator else 0.0
    if core is None or ram is None or gpu is None:
        return None
    return shape.vcpus * core + shape.memory_gib * ram + shape.gpus * gpu


@dataclass
class BillingCatalogSource:
    fetch_skus: Callable[[], Iterable[dict[str, Any]]]
    clock: Callable[[], datetime] = _now

    def quotes(
        self, *, instance_types: Sequence[str], regions: Sequence[str], markets: Sequence[Market],
    ) -> list[PriceQuote]:
        now = self.clock()
        table = parse_skus(self.fetch_skus())
        out = []
        for itype in instance_types:
            shape = SHAPES.get(itype)
            if shape is None:
                continue
            for region in regions:
                for m in markets:
                    p = shape_price(table, shape, region, m)
                    if p is not None:
                        out.append(PriceQuote(cloud="gcp", instance_type=itype, region=region, zone="", market=m,
                                              usd_per_hour=p, fetched_at=now, source="gcp:cloud-billing-catalog"))
        return out


def billing_fetcher(session: Any = None, service_id: str = COMPUTE_SERVICE_ID) -> Callable[[], list[dict[str, Any]]]:
    """Pages through the Cloud Billing catalog with google-auth's standard credential chain."""

    def fetch() -> list[dict[str, Any]]:
        s = session
        if s is None:
            import google.auth  # lazy: only with the gcp extra
            from google.auth.transport.requests import AuthorizedSession

            creds, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-billing.readonly"])
            s = AuthorizedSession(creds)
        skus: list[dict[str, Any]] = []
        token = ""
        while True:
            params = {"pageSize": 5000, **({"pageToken": token} if token else {})}
            resp = s.get(f"https://cloudbilling.googleapis.com/v1/services/{service_id}/skus", params=params)
            resp.raise_for_status()
            body = resp.json()
            skus += body.get("skus", [])
            token = body.get("nextPageToken", "")
            if not token:
                return skus

    return fetch


@dataclass
class SkypilotGcpPriceSource:
    table: CatalogTable
    clock: Callable[[], datetime] = _now

    def quotes(
        self, *, instance_types: Sequence[str], regions: Sequence[str], markets: Sequence[Market],
    ) -> list[PriceQuote]:
        when = self.table.fetched_at or self.clock()
        zones = sorted({(r.region, r.zone) for r in self.table.rows if not regions or r.region in regions})
        out = []
        for itype in instance_types:
            shape = SHAPES.get(itype)
            if shape is None:
                continue
            for region, zone in zones:
                for m in markets:
                    if shape.attached:
                        host = vm_price(self.table, instance_type=shape.machine_type, zone=zone, market=m)
                        gpu = accelerator_price(self.table, gpu_type=shape.gpu_type, zone=zone, market=m)
                        p = None if host is None or gpu is None else host + shape.gpus * gpu
                    else:
                        p = vm_price(self.table, instance_type=itype, zone=zone, market=m)
                    if p is not None:
                        out.append(PriceQuote(cloud="gcp", instance_type=itype, region=region, zone=zone, market=m,
                                              usd_per_hour=p, fetched_at=when,
                                              source=f"catalog:{self.table.source or 'gcp'}"))
        return out
