"""The provider contract (tests/provider_contract.py) for the GCP provider on the local Compute fake.

Counts are the region's GPU quota left (the fake counts usage from live instances, as GCE does), so
asking for more than an offering's count ends in QUOTA_EXCEEDED in every allowed zone: CapacityError.
"""

from __future__ import annotations

import pytest

from infra.catalog import ScriptedPriceSource
from infra.cloud import ScriptedEventSource
from infra.gcp import GceClients, GcpConfig, GcpProvider
from sailor_core.domain import Market
from tests.fakes.gce_fake import GceFake
from tests.provider_contract import ProviderContract

pytestmark = pytest.mark.gcp


@pytest.fixture(scope="module")
def fake():
    f = GceFake(project="contract").start()
    yield f
    f.stop()


class TestGcpProviderContract(ProviderContract):
    @pytest.fixture
    def provider(self, fake):
        fake.reset()
        fake.quotas["us-central1"]["PREEMPTIBLE_NVIDIA_L4_GPUS"] = 3
        prices = ScriptedPriceSource(cloud="gcp")
        prices.set(instance_type="g2-standard-4", zone="us-central1-a", market=Market.SPOT, usd_per_hour=0.22)
        prices.set(instance_type="a2-highgpu-2g", zone="us-central1-b", market=Market.ON_DEMAND, usd_per_hour=7.35)
        yield GcpProvider(GcpConfig(project="contract", regions=("us-central1",)),
                          clients=GceClients(endpoint=fake.endpoint), prices=prices,
                          event_source=ScriptedEventSource())
