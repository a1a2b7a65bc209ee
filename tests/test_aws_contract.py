"""The provider contract (tests/provider_contract.py) for the AWS provider on moto's EC2 server.

The provider is limited to one zone so that asking for more than an offering's count cannot fall
back elsewhere and must raise CapacityError; the count there is `max_vms_per_offering` (moto serves
no Service Quotas for EC2) less the VMs of ours already running.
"""

from __future__ import annotations

import pytest

from infra.aws import AwsConfig, AwsProvider
from infra.catalog import ScriptedPriceSource
from infra.cloud import ScriptedEventSource
from sailor_core.domain import Market
from tests.fakes.moto_server import MotoServer, client_factory
from tests.provider_contract import ProviderContract

pytestmark = pytest.mark.aws


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    yield server
    server.stop()


class TestAwsProviderContract(ProviderContract):
    @pytest.fixture
    def provider(self, moto):
        moto.reset()
        prices = ScriptedPriceSource(cloud="aws")
        prices.set(instance_type="g5.xlarge", zone="us-east-1a", market=Market.SPOT, usd_per_hour=0.40)
        prices.set(instance_type="g5.12xlarge", zone="us-east-1a", market=Market.ON_DEMAND, usd_per_hour=5.672)
        yield AwsProvider(
            AwsConfig(
                regions=("us-east-1",),
                zones=("us-east-1a",),
                image_ids={"us-east-1": "ami-dca37ea5"},
                max_vms_per_offering=2,
                wait_delay_s=0.05,
            ),
            client_for=client_factory(moto.url),
            prices=prices,
            event_source=ScriptedEventSource(),
        )
