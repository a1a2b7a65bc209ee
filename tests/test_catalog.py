"""The SkyPilot-format catalog importer and the pure price queries over its table."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from infra.catalog import (
    CatalogPriceSource,
    ChainedPriceSource,
    ScriptedPriceSource,
    accelerator_price,
    catalog_shapes,
    cheapest,
    load_skypilot_csv,
    load_skypilot_file,
    lookup,
    vm_price,
)
from sailor_core.domain import Market
from sailor_core.errors import SailorError

DATA = Path(__file__).parent / "data"
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.fixture(scope="module")
def aws():
    return load_skypilot_file(DATA / "skypilot_aws_sample.csv", cloud="aws", fetched_at=T0)


def test_importer_keeps_sound_rows_and_reports_each_malformed_one(aws) -> None:
    by_line = {}
    for r in aws.rejected:
        by_line.setdefault(r.line, []).append(r.reason)
    # Whole rows dropped: identical duplicate, both conflicting duplicates, placeholder zeros, blank
    # prices, blank type and accelerator, blank region/zone, a non-numeric GPU count.
    assert "duplicate of line 2" in by_line[3][0]
    assert "conflicting duplicate" in by_line[9][0] and "conflicting duplicate" in by_line[10][0]
    assert "placeholder" in by_line[13][0]
    assert by_line[14] == ["blank Price and SpotPrice"]
    assert by_line[15] == ["blank InstanceType and AcceleratorName"]
    assert by_line[16] == ["blank Region, AvailabilityZone"]
    assert "AcceleratorCount='four'" in by_line[18][0]
    # One market dropped, the row kept: NaN spot, negative on-demand, placeholder on-demand, text spot.
    assert "not a finite price" in by_line[7][0] and "kept the row" in by_line[7][0]
    assert "negative" in by_line[12][0]
    assert "99999 is a placeholder" in by_line[17][0]
    assert "'abc' is not a number" in by_line[19][0]
    assert sorted(by_line) == [3, 7, 9, 10, 12, 13, 14, 15, 16, 17, 18, 19]

    kept = {(r.instance_type, r.zone) for r in aws.rows}
    assert kept == {
        ("p3.2xlarge", "us-east-1a"), ("p3.8xlarge", "us-east-1b"), ("p4d.24xlarge", "us-east-1a"),
        ("p4d.24xlarge", "us-west-2b"), ("p5.48xlarge", "us-east-1a"), ("g5.xlarge", "us-east-1a"),
        ("g6.xlarge", "us-west-2a"), ("g6.12xlarge", "us-west-2b"), ("p4de.24xlarge", "us-east-1c"),
        ("g5.48xlarge", "us-west-2a"),
    }
    p5 = next(r for r in aws.rows if r.instance_type == "p5.48xlarge")
    assert (p5.gpu_type, p5.gpu_count, p5.on_demand_usd_per_hour, p5.spot_usd_per_hour) == ("H100-80", 8, 98.32, None)
    assert "kept 10 rows, rejected 12" in aws.report()


def test_queries_are_pure_functions_of_the_table(aws) -> None:
    assert vm_price(aws, instance_type="p3.2xlarge", zone="us-east-1a", market=Market.SPOT) == pytest.approx(0.918)
    assert vm_price(aws, instance_type="p5.48xlarge", zone="us-east-1a", market=Market.SPOT) is None
    assert vm_price(aws, instance_type="g5.xlarge", zone="us-west-2a", market=Market.ON_DEMAND) is None  # conflicting

    offers = catalog_shapes(aws, regions=["us-east-1"], gpu_types=["V100-16"], markets=[Market.SPOT])
    assert [(o.instance_type, o.zone, round(o.usd_per_gpu_hour, 3)) for o in offers] == [
        ("p3.2xlarge", "us-east-1a", 0.918), ("p3.8xlarge", "us-east-1b", 0.918)]
    best = cheapest(catalog_shapes(aws), gpu_type="A100-40", market=Market.ON_DEMAND)
    assert best is not None and best.instance_type == "p4d.24xlarge" and best.gpus_per_vm == 8
    # no hidden state: asking again, after other queries of the same table, answers the same
    again = catalog_shapes(aws, regions=["us-east-1"], gpu_types=["V100-16"], markets=[Market.SPOT])
    assert [(o.instance_type, o.zone, round(o.usd_per_gpu_hour, 3)) for o in again] == [
        ("p3.2xlarge", "us-east-1a", 0.918), ("p3.8xlarge", "us-east-1b", 0.918)]


def test_gcp_catalog_prices_attachable_gpus_separately() -> None:
    gcp = load_skypilot_file(DATA / "skypilot_gcp_sample.csv", cloud="gcp", fetched_at=T0)
    assert accelerator_price(gcp, gpu_type="V100-16", zone="us-central1-a", market=Market.SPOT) == pytest.approx(0.74)
    assert accelerator_price(gcp, gpu_type="V100-16", zone="us-central1-c", market=Market.SPOT) is None
    assert vm_price(gcp, instance_type="n1-standard-8", zone="us-central1-b", market=Market.ON_DEMAND) == pytest.approx(
        0.379998
    )
    assert {r.line for r in gcp.rejected} == {14, 15}
    a2 = [o for o in catalog_shapes(gcp, gpu_types=["A100-40"]) if o.zone == "us-central1-a"]
    assert {o.instance_type for o in a2} == {"a2-highgpu-1g", "a2-highgpu-8g"}


def test_missing_column_is_an_error_naming_it() -> None:
    with pytest.raises(SailorError, match=r"missing column\(s\) \['SpotPrice'\].*to fix"):
        load_skypilot_csv("InstanceType,AcceleratorName,AcceleratorCount,Price,Region,AvailabilityZone\n", cloud="aws")


def test_price_sources_chain_and_fall_back(aws) -> None:
    class Down:
        def quotes(self, **_):
            raise ConnectionError("feed unreachable")

    live = ScriptedPriceSource(cloud="aws", clock=lambda: T0)
    live.set(instance_type="p3.2xlarge", zone="us-east-1a", market=Market.SPOT, usd_per_hour=0.5)
    chain = ChainedPriceSource([Down(), live, CatalogPriceSource(aws)])
    qs = chain.quotes(instance_types=["p3.2xlarge", "p3.8xlarge"], regions=["us-east-1"], markets=list(Market))
    spot = lookup(qs, instance_type="p3.2xlarge", zone="us-east-1a", market=Market.SPOT)
    assert spot is not None and spot.usd_per_hour == 0.5 and spot.source == "scripted"
    od = lookup(qs, instance_type="p3.8xlarge", zone="us-east-1b", market=Market.ON_DEMAND)
    assert od is not None and od.usd_per_hour == 12.24 and od.fetched_at == T0
    assert chain.errors == ["Down: feed unreachable"]
