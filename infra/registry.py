"""Which cloud provider the environment describes: `provider_from_env("aws" | "gcp", env=...)`.

Contract: builds AwsProvider or GcpProvider (infra/aws, infra/gcp, whose cloud SDKs are imported
only when a provider is built, so the other cloud's SDK is never loaded) from settings the caller's
`env` holds; credentials come from the SDKs' own chains, never from here. An unknown name, or GCP
without a project, is a one-line `ProviderError`. It sits above infra/cloud.py (the pieces both
clouds share) and the two clouds, so none of them imports it back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infra.aws import from_environment as aws_from_env
from infra.cloud import EventSource
from infra.gcp import from_environment as gcp_from_env
from sailor_core.errors import ProviderError


def _csv(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


DEFAULT_REGIONS = {"aws": ("us-east-1", "us-west-2"), "gcp": ("us-central1", "europe-west4")}


def provider_from_env(
    name: str, *, env: Mapping[str, str], regions: Sequence[str] | None = None,
    event_source: EventSource | None = None,
) -> Any:
    """Build the aws or gcp provider from settings in `env` (the caller passes os.environ).

    aws: regions from `regions`, else SAILOR_AWS_REGIONS (comma list); boto3's standard credential
    chain (AWS_PROFILE, env, SSO, instance role); SAILOR_AWS_ENDPOINT_URL points EC2 elsewhere
    (boto3 also honours AWS_ENDPOINT_URL); SAILOR_AWS_IMAGE_IDS=region=ami,...; SAILOR_AWS_INSTANCE_PROFILE.
    gcp: SAILOR_GCP_PROJECT (else GOOGLE_CLOUD_PROJECT), regions or SAILOR_GCP_REGIONS; google-auth's
    application default credentials; SAILOR_GCE_ENDPOINT points Compute elsewhere (a loopback
    endpoint uses anonymous credentials); SAILOR_GCP_LIVE_PRICES=0 skips the billing catalog.
    Both: SAILOR_<CLOUD>_CATALOG is a SkyPilot-format CSV used as the price fallback.
    """
    name = name.lower()
    if name == "aws":

        regs = tuple(regions or _csv(env.get("SAILOR_AWS_REGIONS", "")) or DEFAULT_REGIONS["aws"])
        images = dict(kv.split("=", 1) for kv in _csv(env.get("SAILOR_AWS_IMAGE_IDS", "")) if "=" in kv)
        extra: dict[str, Any] = {"image_ids": images} if images else {}
        if env.get("SAILOR_AWS_INSTANCE_PROFILE"):
            extra["instance_profile"] = env["SAILOR_AWS_INSTANCE_PROFILE"]
        return aws_from_env(regs, catalog_csv=env.get("SAILOR_AWS_CATALOG") or None,
                            endpoint_url=env.get("SAILOR_AWS_ENDPOINT_URL") or None, event_source=event_source,
                            **extra)
    if name == "gcp":

        project = env.get("SAILOR_GCP_PROJECT") or env.get("GOOGLE_CLOUD_PROJECT", "")
        if not project:
            raise ProviderError("no GCP project set; to fix: export SAILOR_GCP_PROJECT=my-project")
        regs = tuple(regions or _csv(env.get("SAILOR_GCP_REGIONS", "")) or DEFAULT_REGIONS["gcp"])
        return gcp_from_env(project, regs, catalog_csv=env.get("SAILOR_GCP_CATALOG") or None,
                            endpoint=env.get("SAILOR_GCE_ENDPOINT") or None, event_source=event_source,
                            live_prices=env.get("SAILOR_GCP_LIVE_PRICES", "1") != "0")
    raise ProviderError(f"unknown cloud provider {name!r}; to fix: use aws or gcp")
