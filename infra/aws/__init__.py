"""AWS provider package (boto3, imported lazily): `AwsProvider`, its config, price feeds and shapes.

`from_environment(regions, ...)` builds a provider from boto3's standard credential chain; prices
come from spot price history and the price list, falling back to a SkyPilot catalog CSV if given.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from infra.aws.prices import PriceListSource, SpotPriceHistorySource
from infra.aws.provider import AwsConfig, AwsProvider, boto3_clients
from infra.catalog import CatalogPriceSource, ChainedPriceSource, PriceSource, load_skypilot_file
from infra.cloud import EventSource

__all__ = ["AwsConfig", "AwsProvider", "boto3_clients", "from_environment"]


def from_environment(
    regions: Sequence[str], *, catalog_csv: str | Path | None = None, endpoint_url: str | None = None,
    event_source: EventSource | None = None, **config: object,
) -> AwsProvider:

    client_for = boto3_clients(endpoint_url=endpoint_url)
    sources: list[PriceSource] = [
        SpotPriceHistorySource(lambda region: client_for("ec2", region)),
        PriceListSource(client_for("pricing", "us-east-1")),
    ]
    if catalog_csv:
        sources.append(CatalogPriceSource(load_skypilot_file(catalog_csv, cloud="aws")))
    return AwsProvider(AwsConfig(regions=tuple(regions), **config),  # type: ignore[arg-type]
                       client_for=client_for, prices=ChainedPriceSource(sources), event_source=event_source)


def credentials_available() -> bool:
    """Whether boto3's standard chain finds credentials (never returns or logs them)."""
    import boto3

    return boto3.session.Session().get_credentials() is not None
