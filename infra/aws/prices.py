"""AWS price feeds behind infra.catalog.PriceSource: spot price history and the price list.

Contract:
- `SpotPriceHistorySource(client_for)` asks EC2 `DescribeSpotPriceHistory` in each region for the
  latest Linux/UNIX spot price per (instance type, availability zone); `client_for(region)` returns
  an EC2 client (boto3, or one pointed at moto).
- `PriceListSource(pricing_client)` asks the AWS Price List `GetProducts` for on-demand Linux,
  shared-tenancy prices per (instance type, region) and quotes them region-wide (zone "").
Both stamp each quote with the time they fetched it (from the injected clock). They return only
what the API returned; a price they cannot read is skipped, never invented.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from infra.catalog import PriceQuote
from sailor_core.domain import Market


def _now() -> datetime:
    return datetime.now(UTC)


@dataclass
class SpotPriceHistorySource:
    client_for: Callable[[str], Any]
    clock: Callable[[], datetime] = _now
    lookback: timedelta = timedelta(hours=3)

    def quotes(
        self, *, instance_types: Sequence[str], regions: Sequence[str], markets: Sequence[Market],
    ) -> list[PriceQuote]:
        if Market.SPOT not in markets or not instance_types:
            return []
        out = []
        for region in regions:
            now = self.clock()
            client = self.client_for(region)
            latest: dict[tuple[str, str], tuple[datetime, float]] = {}
            pages = client.get_paginator("describe_spot_price_history").paginate(
                InstanceTypes=list(instance_types), ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"],
                StartTime=now - self.lookback,
            )
            for page in pages:
                for h in page.get("SpotPriceHistory", []):
                    try:
                        price = float(h["SpotPrice"])
                    except (KeyError, ValueError):
                        continue
                    key = (h["InstanceType"], h["AvailabilityZone"])
                    ts = h.get("Timestamp") or now
                    if key not in latest or ts > latest[key][0]:
                        latest[key] = (ts, price)
            for (itype, zone), (_, price) in sorted(latest.items()):
                out.append(PriceQuote(cloud="aws", instance_type=itype, region=region, zone=zone,
                                      market=Market.SPOT, usd_per_hour=price, fetched_at=now,
                                      source="aws:spot-price-history"))
        return out


def _term_filters(instance_type: str, region: str) -> list[dict[str, str]]:
    pairs = {"instanceType": instance_type, "regionCode": region, "operatingSystem": "Linux",
             "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used"}
    return [{"Type": "TERM_MATCH", "Field": k, "Value": v} for k, v in pairs.items()]


def on_demand_usd_per_hour(product_json: str | dict[str, Any]) -> float | None:
    """The hourly USD price of one price-list product, None if it has none."""
    p = json.loads(product_json) if isinstance(product_json, str) else product_json
    for term in p.get("terms", {}).get("OnDemand", {}).values():
        for dim in term.get("priceDimensions", {}).values():
            if dim.get("unit") in ("Hrs", "Hours"):
                try:
                    v = float(dim["pricePerUnit"]["USD"])
                except (KeyError, ValueError):
                    continue
                if v > 0:
                    return v
    return None


@dataclass
class PriceListSource:
    pricing_client: Any
    clock: Callable[[], datetime] = _now
    errors: list[str] = field(default_factory=list)

    def quotes(
        self, *, instance_types: Sequence[str], regions: Sequence[str], markets: Sequence[Market],
    ) -> list[PriceQuote]:
        if Market.ON_DEMAND not in markets:
            return []
        out = []
        for region in regions:
            for itype in instance_types:
                now = self.clock()
                resp = self.pricing_client.get_products(
                    ServiceCode="AmazonEC2", Filters=_term_filters(itype, region), FormatVersion="aws_v1",
                    MaxResults=10,
                )
                prices = [p for p in (on_demand_usd_per_hour(s) for s in resp.get("PriceList", [])) if p is not None]
                if not prices:
                    continue
                out.append(PriceQuote(cloud="aws", instance_type=itype, region=region, zone="",
                                      market=Market.ON_DEMAND, usd_per_hour=min(prices), fetched_at=now,
                                      source="aws:price-list"))
        return out
