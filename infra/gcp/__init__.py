"""GCP provider package (google-cloud-compute, imported lazily): `GcpProvider`, config, prices, shapes.

`from_environment(project, regions, ...)` builds a provider from google-auth's standard chain
(application default credentials); prices come from the Cloud Billing catalog, falling back to a
SkyPilot GCP catalog CSV if given. `endpoint` points the Compute clients at another server.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from infra.catalog import ChainedPriceSource, PriceSource, load_skypilot_file
from infra.cloud import EventSource
from infra.gcp.prices import BillingCatalogSource, SkypilotGcpPriceSource, billing_fetcher
from infra.gcp.provider import GceClients, GcpConfig, GcpProvider, gce_name

__all__ = ["GceClients", "GcpConfig", "GcpProvider", "from_environment", "gce_name"]


def from_environment(
    project: str, regions: Sequence[str], *, catalog_csv: str | Path | None = None, endpoint: str | None = None,
    event_source: EventSource | None = None, live_prices: bool = True, **config: object,
) -> GcpProvider:

    sources: list[PriceSource] = [BillingCatalogSource(billing_fetcher())] if live_prices else []
    if catalog_csv:
        sources.append(SkypilotGcpPriceSource(load_skypilot_file(catalog_csv, cloud="gcp")))
    return GcpProvider(GcpConfig(project=project, regions=tuple(regions), **config),  # type: ignore[arg-type]
                       clients=GceClients(endpoint=endpoint), prices=ChainedPriceSource(sources),
                       event_source=event_source)
