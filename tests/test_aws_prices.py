"""AWS price feeds: the Price List (botocore Stubber checks the exact request) and spot history parsing."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import boto3
import pytest
from botocore.stub import Stubber

from infra.aws.prices import PriceListSource, on_demand_usd_per_hour
from sailor_core.domain import Market

pytestmark = pytest.mark.aws
SAMPLE = json.loads((Path(__file__).parent / "data" / "aws_price_list_sample.json").read_text())
T0 = datetime(2026, 3, 1, tzinfo=UTC)


def test_price_list_source_sends_the_filters_and_reads_the_hourly_price() -> None:
    client = boto3.client(
        "pricing", region_name="us-east-1", aws_access_key_id="AKIAFAKE", aws_secret_access_key="fake"
    )
    entry = {k: v for k, v in SAMPLE.items() if k != "_comment"}
    with Stubber(client) as stub:
        stub.add_response("get_products", {"PriceList": [json.dumps(entry)], "FormatVersion": "aws_v1"}, {
            "ServiceCode": "AmazonEC2", "FormatVersion": "aws_v1", "MaxResults": 10,
            "Filters": [{"Type": "TERM_MATCH", "Field": f, "Value": v} for f, v in (
                ("instanceType", "g5.xlarge"), ("regionCode", "us-east-1"), ("operatingSystem", "Linux"),
                ("tenancy", "Shared"), ("preInstalledSw", "NA"), ("capacitystatus", "Used"))]})
        stub.add_response("get_products", {"PriceList": [], "FormatVersion": "aws_v1"})
        src = PriceListSource(client, clock=lambda: T0)
        quotes = src.quotes(instance_types=["g5.xlarge", "p5.48xlarge"], regions=["us-east-1"],
                            markets=list(Market))
        stub.assert_no_pending_responses()
    assert [(q.instance_type, q.region, q.zone, q.market, q.usd_per_hour, q.fetched_at) for q in quotes] == [
        ("g5.xlarge", "us-east-1", "", Market.ON_DEMAND, 1.006, T0)]  # p5: no product, no quote
    assert src.quotes(instance_types=["g5.xlarge"], regions=["us-east-1"], markets=[Market.SPOT]) == []


def test_product_without_an_hourly_price_has_none() -> None:
    entry = json.loads(json.dumps(SAMPLE))
    dims = entry["terms"]["OnDemand"]["SKUG5XL.JRTCKXETXF"]["priceDimensions"]
    next(iter(dims.values()))["pricePerUnit"]["USD"] = "0.0000000000"
    assert on_demand_usd_per_hour(entry) is None
    assert on_demand_usd_per_hour(json.dumps(SAMPLE)) == 1.006
