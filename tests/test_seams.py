"""The typed seams between flows/ and tasks/: the flow's parameters declared once, optional provider
capabilities asked by isinstance, a lost worker told from a lost VM by who reported it, a stop told
from a failure by the exception's class, and what the run's VMs cost (tasks/ledger.py)."""

from __future__ import annotations

import asyncio
import enum
import inspect
from datetime import UTC, datetime

import pytest

from flows.params import SailorParams, flat_signature
from infra.provider import (
    AgentExitCodes,
    ClusterInfo,
    DryRunReporting,
    EventKind,
    HostedVms,
    ProviderEvent,
    Reporter,
    Vm,
)
from sailor_core.domain import Market
from tasks import interrupt
from tasks.decisions import awaits_cause, lost_vms
from tasks.ledger import Ledger


def test_the_flow_takes_one_keyword_per_parameter_field_with_its_default() -> None:
    from flows.sailor import sailor

    params = inspect.signature(sailor.fn).parameters
    assert list(params) == [*SailorParams.model_fields, "deps"]
    for name, f in SailorParams.model_fields.items():
        default = f.default.value if isinstance(f.default, enum.Enum) else f.default
        assert params[name].default == default, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
    # choices arrive as the text a deployment's YAML or the UI sends; the model checks them all at once
    assert params["objective"].annotation is str and params["objective"].default == "min-cost"
    assert params["provider"].annotation is str and params["isolation"].annotation is str
    assert params["deps"].default is None


def test_a_flat_signature_keeps_the_functions_own_parameters_after_the_fields() -> None:
    def fn(deps: object = None, **parameters: object) -> None: ...

    sig = flat_signature(SailorParams, fn)
    assert list(sig.parameters)[-1] == "deps" and "parameters" not in sig.parameters
    assert sig.parameters["steps"].annotation == (int | None)


class _Probe:
    """Offers only some capabilities, as a provider does by having the members."""

    isolation = "process"
    env: dict[str, str] = {}

    def agent_exit_code(self, vm_id: str) -> int | None:
        return None

    def host_address(self, run_id: str) -> str:
        return "127.0.0.1"


def test_optional_capabilities_are_asked_by_isinstance() -> None:
    p = _Probe()
    assert isinstance(p, AgentExitCodes) and isinstance(p, HostedVms)
    assert not isinstance(p, ClusterInfo) and not isinstance(p, DryRunReporting)


def test_the_local_provider_offers_its_capabilities(tmp_path) -> None:
    from infra.local import LocalProvider

    p = LocalProvider(tmp_path)
    assert isinstance(p, AgentExitCodes) and isinstance(p, ClusterInfo) and isinstance(p, HostedVms)
    assert not isinstance(p, DryRunReporting)


def _lost(vm: str, by: Reporter) -> ProviderEvent:
    return ProviderEvent(kind=EventKind.LOST, at=datetime.now(UTC), vm_id=vm, reported_by=by,
                         detail={"reason": "worker reported failed: peer gone" if by is Reporter.WORKERS else "gone"})


def test_workers_failing_beside_a_lost_vm_are_collateral() -> None:
    events = [_lost("a", Reporter.PROVIDER), _lost("b", Reporter.WORKERS), _lost("c", Reporter.WORKERS)]
    assert lost_vms(events, {"a", "b", "c"}) == {"a"}
    # the provider saw nothing go: the VMs whose workers failed are the ones to replace
    assert lost_vms(events[1:], {"a", "b", "c"}) == {"b", "c"}
    assert lost_vms(events, {"b"}) == set()  # a VM the plan no longer uses
    price = ProviderEvent(kind=EventKind.PRICE_CHANGE, at=datetime.now(UTC))
    assert lost_vms([price], {"a"}) == set()


def test_workers_failures_alone_wait_a_moment_for_the_provider_to_name_the_vm_that_went() -> None:
    # A killed worker's peer fails its collective 0.1 s before the provider sees the kill: answering the peer's
    # report at once took the survivor for the lost VM, planned on the dead one, and waited 60 s for its agents.
    soft, hard = [_lost("b", Reporter.WORKERS)], [_lost("a", Reporter.PROVIDER)]
    assert awaits_cause(soft, None, now=100.0)  # first seen now
    assert awaits_cause(soft, 100.0, now=104.9)
    assert not awaits_cause(soft, 100.0, now=105.0)  # the provider named none in 5 s: the workers' word goes
    assert not awaits_cause(soft + hard, 100.0, now=100.5)  # the cause is known: answer at once
    price = [ProviderEvent(kind=EventKind.PRICE_CHANGE, at=datetime.now(UTC))]
    assert awaits_cause(soft + price, 100.0, now=101.0)  # a price change beside says nothing of which VM went
    assert not awaits_cause(price, None, now=0.0)
    assert not awaits_cause([], None, now=0.0)


@pytest.mark.parametrize("error, stop", [
    (KeyboardInterrupt(), True), (interrupt.Terminated(15), True), (interrupt.Interrupted(2), True),
    (asyncio.CancelledError(), True), (RuntimeError("boom"), False), (ValueError("Task run is not set"), False),
])
def test_a_stop_is_told_from_a_failure_by_class(error: BaseException, stop: bool) -> None:
    assert interrupt.is_stop(error) is stop


def test_prefect_terminating_the_run_is_a_stop() -> None:
    from prefect.exceptions import TerminationSignal

    assert interrupt.is_stop(TerminationSignal(15))


def _vm(vm_id: str, usd_per_hour: float) -> Vm:
    return Vm(vm_id=vm_id, run_id="r", name=vm_id, zone="z", gpu_type="cpu", gpus=1, market=Market.ON_DEMAND,
              usd_per_hour=usd_per_hour)


def test_the_ledger_charges_each_vm_from_its_rent_to_its_release() -> None:
    now = [0.0]
    ledger = Ledger(clock=lambda: now[0])
    ledger.rent([_vm("a", 3.6), _vm("b", 7.2)])
    now[0] = 1800.0
    ledger.release(["a", "not-rented"])
    now[0] = 3600.0
    ledger.release(["a"])  # released twice: the first end counts
    assert ledger.usd_so_far() == pytest.approx(3.6 * 0.5 + 7.2 * 1.0)
    assert ledger.usd_per_hour_now() == pytest.approx(7.2) and len(ledger) == 2
    ledger.release_all()
    now[0] = 7200.0
    assert ledger.usd_so_far() == pytest.approx(3.6 * 0.5 + 7.2 * 1.0) and ledger.usd_per_hour_now() == 0.0
