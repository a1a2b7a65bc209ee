"""The provider contract: what every Provider (local, aws, gcp) must do, as one reusable test class.

To check a provider, subclass `ProviderContract` in a test module and implement `make_provider`
(a fresh provider with some capacity, its side effects pointed at test doubles or local servers):

    class TestMyProvider(ProviderContract):
        @pytest.fixture
        def provider(self, tmp_path):
            yield MyProvider(...)

        def vm_request(self, offering, run_id, name):   # optional: how to ask for one VM
            ...

Each test provisions under its own run id and cleans up in a finally. Tests that need something a
provider cannot do offline override the matching `supports_*` attribute to False, and say why.
`Clock` is the settable clock the cloud provider tests hand their providers.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from infra.provider import EventKind, Provider, ProviderEvent, Vm, VmRequest, WorkerAssignment
from sailor_core.domain import Capacity, Market
from sailor_core.errors import CapacityError, ProviderError


class Clock:
    """A clock the test sets: a provider's `clock=` for cooldowns, price fetch times and event times."""

    def __init__(self) -> None:
        self.now = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now

    def tick(self, s: float = 60) -> None:
        self.now += timedelta(seconds=s)


class ProviderContract:
    # Can the test ask for more than an offering's `gpus` and expect CapacityError?
    supports_capacity_error = True

    @pytest.fixture
    def provider(self, tmp_path):  # pragma: no cover - must be overridden
        raise NotImplementedError("subclass ProviderContract and define a `provider` fixture")

    def vm_request(self, offering: Capacity, run_id: str, name: str) -> VmRequest:
        return VmRequest(run_id=run_id, name=name, zone=offering.zone, region=offering.region,
                         gpu_type=offering.gpu_type, gpus=offering.gpus_per_vm, market=offering.market,
                         instance_type=offering.instance_type)

    def assignment(self, run_id: str) -> WorkerAssignment:
        return WorkerAssignment(run_id=run_id, plan_version=1, plan_json="{}", rendezvous_endpoint="127.0.0.1:29500",
                                ranks=(0,), world_size=1)

    @staticmethod
    def run_id() -> str:
        return f"contract-{uuid.uuid4().hex[:8]}"

    def first_offering(self, provider: Provider) -> Capacity:
        offers = [o for o in provider.offerings() if o.gpus >= o.gpus_per_vm]
        assert offers, "a provider under contract test must offer at least one VM's worth of GPUs"
        return offers[0]

    # -----------------------------------------------------------------------------------------
    def test_is_a_provider(self, provider):
        assert isinstance(provider, Provider)
        assert isinstance(provider.name, str) and provider.name

    def test_offerings_are_well_formed(self, provider):
        offers = provider.offerings()
        assert offers
        for o in offers:
            assert isinstance(o, Capacity)
            assert o.gpus >= 0 and o.gpus_per_vm >= 1
            assert o.usd_per_gpu_hour >= 0
            assert isinstance(o.market, Market)
            assert o.gpus == o.vms * o.gpus_per_vm, f"{o.key}: {o.gpus} GPUs are not whole VMs of {o.gpus_per_vm}"

    def test_offerings_filters(self, provider):
        assert provider.offerings(gpu_types=["no-such-gpu"]) == []
        assert provider.offerings(regions=["no-such-region"]) == []
        o = self.first_offering(provider)
        only = provider.offerings(gpu_types=[o.gpu_type], markets=[o.market])
        assert only and all(x.gpu_type == o.gpu_type and x.market == o.market for x in only)

    def test_dry_run_rents_nothing(self, provider):
        run_id = self.run_id()
        o = self.first_offering(provider)
        vms = provider.provision([self.vm_request(o, run_id, "w0")], dry_run=True)
        assert len(vms) == 1 and isinstance(vms[0], Vm)
        assert provider.list_vms(run_id) == []

    def test_provision_tags_the_run_and_terminate_frees(self, provider):
        run_id = self.run_id()
        o = self.first_offering(provider)
        try:
            vms = provider.provision([self.vm_request(o, run_id, "w0")])
            assert len(vms) == 1
            vm = vms[0]
            assert vm.run_id == run_id and vm.gpu_type == o.gpu_type and vm.market == o.market
            listed = provider.list_vms(run_id)
            assert [v.vm_id for v in listed] == [vm.vm_id]
            assert listed[0].state == "running"
            assert all(v.run_id == run_id for v in provider.list_vms(run_id))
            provider.terminate([vm.vm_id])
            assert all(v.state != "running" for v in provider.list_vms(run_id))
            provider.terminate([vm.vm_id])  # idempotent
        finally:
            provider.cleanup(run_id)

    def test_cleanup_removes_everything_of_a_run_and_only_that(self, provider):
        a, b = self.run_id(), self.run_id()
        o = self.first_offering(provider)
        try:
            va = provider.provision([self.vm_request(o, a, "w0")])[0]
            vb = provider.provision([self.vm_request(o, b, "w0")])[0]
            assert provider.cleanup(a, dry_run=True) == [va.vm_id]
            assert any(v.state == "running" for v in provider.list_vms(a))  # dry run removed nothing
            assert provider.cleanup(a) == [va.vm_id]
            assert all(v.state != "running" for v in provider.list_vms(a))
            assert [v.state for v in provider.list_vms(b)] == ["running"]
            assert provider.cleanup(a) == []
            assert vb.vm_id in provider.cleanup(b)
        finally:
            provider.cleanup(a)
            provider.cleanup(b)

    def test_capacity_is_enforced(self, provider):
        if not self.supports_capacity_error:
            pytest.skip("this provider cannot be driven out of capacity offline")
        run_id = self.run_id()
        o = self.first_offering(provider)
        n = o.gpus // o.gpus_per_vm + 1
        try:
            with pytest.raises(CapacityError):
                provider.provision([self.vm_request(o, run_id, f"w{i}") for i in range(n)])
        finally:
            provider.cleanup(run_id)

    def test_renting_lowers_what_is_offered(self, provider):
        if not self.supports_capacity_error:
            pytest.skip("this provider's offered counts do not track our own rentals")
        run_id = self.run_id()
        o = self.first_offering(provider)
        try:
            provider.provision([self.vm_request(o, run_id, "w0")])
            after = provider.offerings(gpu_types=[o.gpu_type], markets=[o.market], regions=[o.region])
            assert sum(x.gpus for x in after if x.zone == o.zone) == o.gpus - o.gpus_per_vm
        finally:
            provider.cleanup(run_id)

    def test_bootstrap_needs_a_live_vm(self, provider):
        run_id = self.run_id()
        o = self.first_offering(provider)
        try:
            vm = provider.provision([self.vm_request(o, run_id, "w0")])[0]
            provider.terminate([vm.vm_id])
            with pytest.raises(ProviderError):
                provider.bootstrap(vm, self.assignment(run_id))
        finally:
            provider.cleanup(run_id)

    def test_events_are_typed_and_filtered_by_time(self, provider):
        run_id = self.run_id()
        o = self.first_offering(provider)
        try:
            provider.provision([self.vm_request(o, run_id, "w0")])
            evs = provider.events(run_id)
            assert isinstance(evs, list)
            for e in evs:
                assert isinstance(e, ProviderEvent) and isinstance(e.kind, EventKind)
            future = datetime.now(UTC) + timedelta(days=1)
            assert provider.events(run_id, since=future) == []
        finally:
            provider.cleanup(run_id)
