"""Against a real AWS account (marked `cloud`; skipped unless SAILOR_CLOUD_TESTS=1 and credentials exist).

Read-only and free: live offerings with spot and price-list prices, and a dry run. Nothing is rented.
"""

from __future__ import annotations

import os

import pytest

from sailor_core.domain import Market

pytestmark = [pytest.mark.cloud, pytest.mark.skipif(os.environ.get("SAILOR_CLOUD_TESTS") != "1",
                                                    reason="needs a real AWS account: set SAILOR_CLOUD_TESTS=1")]


def test_live_offerings_and_dry_run_on_a_real_account() -> None:
    from infra.aws import credentials_available, from_environment
    from infra.cloud import format_dry_run
    from infra.provider import VmRequest

    if not credentials_available():
        pytest.skip("no AWS credentials in the standard chain")
    p = from_environment(["us-east-1"])
    offers = p.offerings(gpu_types=["A10G-24"], markets=[Market.SPOT])
    assert offers and all(o.usd_per_gpu_hour > 0 and o.price_fetched_at for o in offers)
    o = offers[0]
    vms = p.provision([VmRequest(run_id="cloud-dry", name="w0", zone=o.zone, gpu_type=o.gpu_type, gpus=1,
                                 market=Market.SPOT)], dry_run=True)
    assert vms[0].state == "planned" and "RunInstances" in format_dry_run(p.last_dry_run)
    assert p.list_vms("cloud-dry") == []
