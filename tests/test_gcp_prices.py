"""GCP price feeds: Cloud Billing catalog SKUs (a sample in the API's format) and SkyPilot's GCP CSV."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from infra.catalog import load_skypilot_file, lookup
from infra.gcp.prices import BillingCatalogSource, SkypilotGcpPriceSource, parse_skus
from sailor_core.domain import Market

pytestmark = pytest.mark.gcp
DATA = Path(__file__).parent / "data"
T0 = datetime(2026, 3, 1, tzinfo=UTC)
V100 = "n1-standard-8+nvidia-tesla-v100:1"


def skus():
    return json.loads((DATA / "gcp_billing_skus_sample.json").read_text())["skus"]


def test_billing_catalog_prices_shapes_from_core_ram_and_gpu_skus() -> None:
    table = parse_skus(skus())
    assert ("gpu", "nvidia-tesla-v100", "us-central1", Market.SPOT) in table
    assert table[("gpu", "nvidia-tesla-v100", "us-central1", Market.ON_DEMAND)] == pytest.approx(
        2.48
    )  # not the commitment
    src = BillingCatalogSource(skus, clock=lambda: T0)
    qs = src.quotes(instance_types=[V100, "g2-standard-4", "a2-highgpu-1g"], regions=["us-central1", "us-east1"],
                    markets=list(Market))
    od = lookup(qs, instance_type=V100, zone="us-central1-a", market=Market.ON_DEMAND)
    assert od.usd_per_hour == pytest.approx(8 * 0.031611 + 30 * 0.004237 + 2.48) and od.fetched_at == T0
    spot = lookup(qs, instance_type=V100, zone="us-central1-b", market=Market.SPOT)
    assert spot.usd_per_hour == pytest.approx(8 * 0.006655 + 30 * 0.000892 + 0.74)
    l4 = lookup(qs, instance_type="g2-standard-4", zone="us-central1-a", market=Market.ON_DEMAND)
    assert l4.usd_per_hour == pytest.approx(4 * 0.024988 + 16 * 0.002928 + 0.56004)
    assert lookup(qs, instance_type="g2-standard-4", zone="us-central1-a", market=Market.SPOT) is None
    assert lookup(qs, instance_type="a2-highgpu-1g", zone="us-central1-a", market=Market.ON_DEMAND) is None
    assert lookup(qs, instance_type=V100, zone="us-east1-b", market=Market.ON_DEMAND) is None  # no GPU SKU there


def test_skypilot_gcp_catalog_composes_n1_host_and_attached_gpus() -> None:
    table = load_skypilot_file(DATA / "skypilot_gcp_sample.csv", cloud="gcp", fetched_at=T0)
    qs = SkypilotGcpPriceSource(table).quotes(
        instance_types=[V100, "a2-highgpu-1g", "n1-standard-16+nvidia-tesla-v100:2"],
        regions=["us-central1"],
        markets=list(Market),
    )
    v = lookup(qs, instance_type=V100, zone="us-central1-a", market=Market.SPOT)
    assert v.usd_per_hour == pytest.approx(0.08 + 0.74) and v.fetched_at == T0
    assert (
        lookup(qs, instance_type="a2-highgpu-1g", zone="us-central1-b", market=Market.ON_DEMAND).usd_per_hour == 3.673
    )
    assert lookup(qs, instance_type="n1-standard-16+nvidia-tesla-v100:2", zone="us-central1-a",
                  market=Market.SPOT) is None  # no n1-standard-16 host row in the sample
