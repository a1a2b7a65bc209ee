"""Against a real GCP project (marked `cloud`; skipped unless SAILOR_CLOUD_TESTS=1 and SAILOR_GCP_PROJECT).

Read-only and free: live offerings priced from the Cloud Billing catalog, and a dry run.
"""

from __future__ import annotations

import os

import pytest

from sailor_core.domain import Market

pytestmark = [pytest.mark.cloud, pytest.mark.skipif(
    os.environ.get("SAILOR_CLOUD_TESTS") != "1" or not os.environ.get("SAILOR_GCP_PROJECT"),
    reason="needs a real GCP project: set SAILOR_CLOUD_TESTS=1 and SAILOR_GCP_PROJECT")]


def test_live_offerings_and_dry_run_on_a_real_project() -> None:
    from infra.cloud import format_dry_run
    from infra.provider import VmRequest
    from infra.registry import provider_from_env

    p = provider_from_env("gcp", env=os.environ, regions=["us-central1"])
    offers = p.offerings(gpu_types=["L4-24"], markets=[Market.SPOT])
    assert offers and all(o.usd_per_gpu_hour > 0 for o in offers)
    vms = p.provision([VmRequest(run_id="cloud-dry", name="w0", zone=offers[0].zone, gpu_type="L4-24", gpus=1,
                                 market=Market.SPOT)], dry_run=True)
    assert vms[0].state == "planned" and "instances.insert" in format_dry_run(p.last_dry_run)
