"""The `profile` subflow: make sure the store holds what planning needs for a model on a set of GPUs.

Contract: `profile(store, model, gpu_types, offers=..., remote=...)` returns the store's ProfileBook for
the model on those GPU types after measuring what is missing. Present profiles are read, never
re-measured. With `remote` (tasks/remote.VmCommands) and the provider's offerings, what planning over
them lacks is measured on rented VMs (`profile_on_vms`): the layers of every device type on a VM of it,
the node's own link on a multi-device VM, and the link of every zone pair (`sailor profile link` on a
VM at each end), imported with provenance; the VMs are released. Without them, the GPU type `cpu` is
measured on this machine (the local provider's slots) with the same profiler; a missing profile of
another type fails with the command that makes it. `measure_zone_link` is `sailor profile network
--from/--to`: one zone pair by hand, on VMs rented the same way (a `ZoneLink`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Protocol

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from infra.provider import Provider, Vm
from profiles_store.store import ProfileStore, open_store
from profiles_store.tables import (
    FRAMEWORK_OVERHEAD,
    GPU_TYPES,
    INTRA_NODE_LINKS,
    LAYER_PROFILES,
    LINK_ALLREDUCE,
    MODELS,
    NETWORK_LINKS,
    NODE_ALLREDUCE,
)
from sailor_core.domain import Capacity, LinkAllReduce, NetworkLink, Provenance
from sailor_core.errors import MissingProfileError, SailorError
from sailor_core.models.config import get_config, model_spec
from sailor_core.profiles import ProfileBook
from tasks.control import Controller
from tasks.jobs import ship_code
from tasks.remote import VmCommands
from tasks.runstate import RunState

if TYPE_CHECKING:
    from prefect.states import State

    from flows.params import SailorParams

LOCAL_GPU = "cpu"
LOCAL_ZONE = "local"

End = tuple[str, str]  # (zone, device type) at one end of a link
ZonePair = tuple[tuple[str, str], list[tuple[End, End]]]  # (zone a, zone b), the device-type pairs between them
ProfileJob = tuple[Vm, list[str], tuple[str, str, str]]  # (vm, `sailor` argv, (kind, device type, zone))


class RentingDeps(Protocol):
    """What measuring on rented VMs uses of a run's side effects (flows/sailor.Deps has them)."""

    provider: Provider
    store: ProfileStore
    state: RunState | None  # where the rented VMs' code and results go
    controller_host: str
    ship_wheel: bool
    closers: list[Callable[[], None]]  # run after the VMs are gone (the testbed's object store, ...)


class Log(Protocol):
    """Where progress goes: the run's logger, or the CLI's stderr (`sailor profile network`)."""

    def info(self, msg: str, *args: object) -> None: ...


@dataclass(frozen=True, kw_only=True)
class ZoneLink:
    """What `measure_zone_link` measured and wrote."""

    run_id: str
    link: NetworkLink  # src -> dst, as measured
    vms: list[str]  # the VM at each end (released)
    store: str  # the store's URI
    rows: list[str]  # "zone:type <-> zone:type" for every device-type pair written (both ways)


@task(name="load-profiles", retries=3, retry_delay_seconds=[1, 2, 5], cache_policy=NO_CACHE,
      retry_condition_fn=lambda t, r, s: not isinstance(_exc(s), SailorError))
def load_book(store: ProfileStore, model: str, gpu_types: Sequence[str]) -> ProfileBook:
    return store.profile_book(model, sorted(set(gpu_types)))


def _exc(state: State) -> BaseException | None:
    try:
        state.result()
    except BaseException as e:  # noqa: BLE001 - a retry condition only classifies; Prefect raises the error after the last try
        return e
    return None


@task(name="ensure-model-spec", retries=2, cache_policy=NO_CACHE)
def ensure_model(store: ProfileStore, model: str) -> None:
    """Models the store lacks but the model family defines (gpt-tiny, gpt-small) are written to it."""
    if model in store.model_names():
        return

    store.write(MODELS, [model_spec(get_config(model))])


@task(name="profile-layers", cache_policy=NO_CACHE)
def profile_layers(store: ProfileStore, model: str, mbs: Sequence[int]) -> int:
    """sailor_core.profiler.layers on this machine's CPU; the whole profile is written in one commit."""
    from sailor_core.profiler.layers import ModelProfileSettings, profile_model

    prof = profile_model(ModelProfileSettings(model=model, device="cpu", mbs=tuple(mbs), tp=(1,)))
    store.replace_layer_profiles(model, prof.gpu_type, prof.profiles, provenance=prof.provenance)
    store.write(FRAMEWORK_OVERHEAD, [(prof.gpu_type, prof.framework_overhead_bytes)], provenance=prof.provenance)
    return len(prof.profiles)


@task(name="profile-network", cache_policy=NO_CACHE)
def profile_network(store: ProfileStore) -> int:
    """sailor_core.profiler.network between two local workers: the cpu link and its all-reduce fit."""
    from sailor_core.profiler.network import NetworkSettings
    from sailor_core.profiler.network import profile_network as measure

    prof = measure(NetworkSettings(workers=2, device="cpu", zone=LOCAL_ZONE))
    store.write(NETWORK_LINKS, [prof.link], provenance=prof.provenance)
    store.write(INTRA_NODE_LINKS, [prof.intra_node], provenance=prof.provenance)
    return len(prof.points)


def _has_local_link(book: ProfileBook) -> bool:
    return book.link(LOCAL_ZONE, LOCAL_GPU, 1, LOCAL_ZONE, LOCAL_GPU, 1) is not None or \
        book.intra_node_link(LOCAL_GPU, 2) is not None


def _cheapest(offers: Sequence[Capacity], *, zone: str | None = None, gpu_type: str | None = None,
              gpus_per_vm: int | None = None) -> Capacity | None:
    """The cheapest VM offered now that matches what is given."""
    fits = [o for o in offers if o.gpus > 0 and zone in (None, o.zone) and gpu_type in (None, o.gpu_type)
            and gpus_per_vm in (None, o.gpus_per_vm)]
    return min(fits, key=lambda o: (o.usd_per_gpu_hour * o.gpus_per_vm, o.zone)) if fits else None


def _known_types(store: ProfileStore, gpu_types: Sequence[str]) -> list[str]:
    known = set(store.gpu_types())
    return [g for g in gpu_types if g in known]


def _missing(
    store: ProfileStore, model: str, gpu_types: Sequence[str], offers: Sequence[Capacity]
) -> tuple[list[str], list[ZonePair], list[Capacity]]:
    """What planning over `offers` lacks: layer profiles (types), links (zone pairs), intra-node links (offers)."""
    present = _known_types(store, gpu_types)
    book = store.profile_book(model, present) if present else None
    def lacks(g: str) -> bool:  # no profile, or none at the TP degrees its VMs allow
        if book is None or g not in present or not book.profiled_points(g):
            return True
        most = max((o.gpus_per_vm for o in offers if o.gpu_type == g and o.gpus > 0), default=1)
        return max(t for _, t in book.profiled_points(g)) < min(most, 2)

    types = [g for g in gpu_types if lacks(g)]
    ends = sorted({(o.zone, o.gpu_type) for o in offers if o.gpus > 0})
    links = store.read(NETWORK_LINKS)
    have = {(lk.sender_zone, lk.sender_gpu, lk.receiver_zone, lk.receiver_gpu) for lk in links}
    pairs: dict[tuple[str, str], list[tuple[End, End]]] = {}
    for i, a in enumerate(ends):
        for b in ends[i:]:
            if a == b and sum(o.vms for o in offers if (o.zone, o.gpu_type) == a) < 2:
                continue  # one VM of it at most: no two VMs of it ever talk
            if (a[0], a[1], b[0], b[1]) not in have and (b[0], b[1], a[0], a[1]) not in have:
                pairs.setdefault((min(a[0], b[0]), max(a[0], b[0])), []).append((a, b))
    intra = {(lk.gpu_type, lk.num_gpus) for lk in store.read(INTRA_NODE_LINKS)}
    multi = [o for o in offers if o.gpus > 0 and o.gpus_per_vm >= 2 and (o.gpu_type, 2) not in intra]
    multi = list({o.gpu_type: o for o in multi}.values())
    return types, list(pairs.items()), multi


class _VmPool:
    """The VMs rented for profiling so far, by (zone, device type); rents the cheapest when none fits."""

    def __init__(self, remote: VmCommands, offers: Sequence[Capacity], log: Log) -> None:
        self.remote, self.offers, self.log = remote, offers, log
        self.vms: dict[tuple[str, str], list[Vm]] = {}

    def get(self, zone: str, gpu: str | None = None, avoid: Sequence[Vm | None] = (), *,
            devices: int | None = None) -> Vm | None:
        for (z, g), have in self.vms.items():
            for v in have:
                if (
                    z == zone
                    and (gpu is None or g == gpu)
                    and v not in avoid
                    and (devices is None or v.gpus >= devices)
                ):
                    return v
        fits = [o for o in self.offers if o.gpus_per_vm >= (devices or 1)]
        o = _cheapest(fits, zone=zone, gpu_type=gpu or None)
        if o is None:
            return None
        try:
            v = self.remote.rent(o)
        except Exception as e:  # noqa: BLE001 - no capacity left there: measure what can be
            self.log.info("cannot rent a %s VM in %s for profiling: %s", gpu or "any", zone, e)
            return None
        self.vms.setdefault((zone, o.gpu_type), []).append(v)
        return v


def _layer_jobs(model: str, types: list[str], offers: Sequence[Capacity], pool: _VmPool,
                remote: VmCommands) -> list[ProfileJob]:
    """(vm, command, (kind, type, zone)) per device type: its layers on its largest VM, TP up to its size."""
    jobs: list[ProfileJob] = []
    for g in types:
        most = max((o.gpus_per_vm for o in offers if o.gpu_type == g and o.gpus > 0), default=1)
        o = _cheapest(offers, gpu_type=g, gpus_per_vm=most)
        v = pool.get(o.zone, g, devices=most) if o is not None else None
        if o is None or v is None:
            raise MissingProfileError(f"no VM of {g} can be rented to profile {model} on it",
                                      fix=f"allow a zone or market that offers {g}", kind="vm", model=model, gpu_type=g)
        tps = ",".join(str(t) for t in (1, 2, 4, 8) if t <= max(v.gpus, 1))
        jobs.append((v, ["profile", "model", "--model", model, "--device", _device(o), "--gpu-type", g,
                         "--tp", tps, "--store", remote.store_uri("vm", f"layers-{g}")], ("layers", g, o.zone)))
    return jobs


def _node_jobs(multi: list[Capacity], pool: _VmPool, remote: VmCommands, busy: set[str]) -> list[ProfileJob]:
    """(vm, command, ...) measuring the node's own link and all-reduce on a multi-device VM of each type."""
    jobs: list[ProfileJob] = []
    for o in multi:
        v = pool.get(o.zone, o.gpu_type, devices=2)
        if v is None or v.vm_id in busy:
            continue
        jobs.append((v, ["profile", "network", "--workers", "2", "--zone", o.zone, "--gpu-type", o.gpu_type,
                         "--max-bytes", str(8 * 1024 * 1024), "--store", remote.store_uri("vm", f"node-{o.gpu_type}")],
                     ("node", o.gpu_type, o.zone)))
        busy.add(v.vm_id)
    return jobs


def _measure_links(pairs: list[ZonePair], pool: _VmPool, remote: VmCommands, store: ProfileStore,
                   log: Log) -> list[str]:
    """One zone pair at a time (links measured alone): `sailor profile link` on a VM at each end."""
    done = []
    for (za, zb), combos in pairs:
        got = _measure_pair(pool, remote, (za, None), (zb, None))
        if got is None:
            log.info("cannot measure %s <-> %s: no two VMs there", za, zb)
            continue
        _import_links(got[0], got[1], store, combos, got[2], got[3])
        done.append(f"{za}<->{zb}")
    return done


def _measure_pair(pool: _VmPool, remote: VmCommands, src: tuple[str, str | None],
                  dst: tuple[str, str | None]) -> tuple[NetworkLink, LinkAllReduce, Vm, Vm] | None:
    """(the link src -> dst as measured, the two VMs' all-reduce over it, its VM at src, its VM at dst), or
    None when no two such VMs can be rented:
    `sailor profile link` on a VM at each end (of that device type where given), meeting through the run's
    controller. Its ping-pong crosses the link both ways; the fit stands for both directions."""

    (za, ga), (zb, gb) = src, dst
    a = pool.get(za, ga)
    b = pool.get(zb, gb, avoid=[a])
    if a is None or b is None:
        return None
    name = f"link-{za}-{zb}"
    ends = (f"{za}:{a.gpu_type}", f"{zb}:{b.gpu_type}")
    codes = remote.run([(v, ["profile", "link", "--rank", str(r), "--from", ends[0], "--to", ends[1],
                             "--key", f"links/{za}/{zb}", "--store", remote.store_uri("vm", name)])
                        for r, v in enumerate((a, b))])
    if any(codes.values()):
        raise remote.failure(f"measuring {za} <-> {zb}", codes)
    src_store = open_store(remote.store_uri("flow", name))
    measured = next(lk for lk in src_store.read(NETWORK_LINKS) if (lk.sender_zone, lk.receiver_zone) == (za, zb))
    ar = next(x for x in src_store.read(LINK_ALLREDUCE) if (x.zone_a, x.zone_b) == (za, zb))
    return measured, ar, a, b


@task(name="profile-on-vms", cache_policy=NO_CACHE)
def profile_on_vms(store: ProfileStore, model: str, types: list[str], pairs: list[ZonePair], multi: list[Capacity],
                   offers: Sequence[Capacity], remote: VmCommands) -> dict[str, list[str]]:
    """Rent VMs, run the profilers there (layers per device type, the node's own link on multi-device
    VMs, links per zone pair), import the results into the store, release the VMs."""
    log = get_run_logger()
    measured: dict[str, list[str]] = {"layers": [], "links": [], "intra_node": []}
    pool = _VmPool(remote, offers, log)
    try:
        first = _layer_jobs(model, types, offers, pool, remote)
        busy = {v.vm_id for v, _, _ in first}
        _run_and_import(remote, first + _node_jobs(multi, pool, remote, busy), store, model, measured, log)
        # node links whose VM was busy profiling layers in the first round
        rest = [o for o in multi if o.gpu_type not in measured["intra_node"]]
        _run_and_import(remote, _node_jobs(rest, pool, remote, set()), store, model, measured, log)
        measured["links"] = _measure_links(pairs, pool, remote, store, log)
    finally:
        remote.release()
    return measured


def _device(offer: Capacity) -> str:
    return "cpu" if offer.cloud == "local" else "cuda"


def _run_and_import(remote: VmCommands, jobs: list[ProfileJob], store: ProfileStore, model: str,
                    measured: dict[str, list[str]], log: Log) -> None:

    if not jobs:
        return
    log.info("profiling on %d rented VM(s): %s", len(jobs), sorted(f"{k} {g} in {z}" for _, _, (k, g, z) in jobs))
    codes = remote.run([(vm, cmd) for vm, cmd, _ in jobs])
    if any(codes.values()):
        raise remote.failure("profiling", codes)
    for vm, _, (kind, g, zone) in jobs:
        src = open_store(remote.store_uri("flow", f"{kind}-{g}"))
        prov = _provenance(vm, zone, remote.run_id)
        if kind == "layers":
            store.write(GPU_TYPES, [src.gpu_types()[g]], provenance=prov)
            store.replace_layer_profiles(model, g, src.read(LAYER_PROFILES, {"model": model, "gpu_type": g}),
                                         provenance=prov)
            store.write(FRAMEWORK_OVERHEAD, [o for o in src.read(FRAMEWORK_OVERHEAD) if o[0] == g], provenance=prov)
            measured["layers"].append(g)
        else:
            store.write(INTRA_NODE_LINKS, [x for x in src.read(INTRA_NODE_LINKS) if x.gpu_type == g], provenance=prov)
            store.write(NODE_ALLREDUCE, [x for x in src.read(NODE_ALLREDUCE) if x.gpu_type == g], provenance=prov)
            measured["intra_node"].append(g)


def _import_links(measured: NetworkLink, allreduce: LinkAllReduce, store: ProfileStore,
                  combos: list[tuple[End, End]], a: Vm, b: Vm) -> None:
    """The measured link of a zone pair (and the all-reduce over it), for every device-type pair of those
    zones the plans may use: on one network the link is the zones', measured once between two of their VMs."""

    rows, ars = [], []
    for (za, ga), (zb, gb) in combos:
        fwd = replace(measured, sender_zone=za, sender_gpu=ga, receiver_zone=zb, receiver_gpu=gb)
        rows += [fwd, replace(fwd, sender_zone=zb, sender_gpu=gb, receiver_zone=za, receiver_gpu=ga)]
        ars += [LinkAllReduce(zone_a=za, gpu_a=ga, zone_b=zb, gpu_b=gb, fit=allreduce.fit),
                LinkAllReduce(zone_a=zb, gpu_a=gb, zone_b=za, gpu_b=ga, fit=allreduce.fit)]
    store.write(NETWORK_LINKS, rows, provenance=_provenance(a, a.zone, "", peer=b))
    store.write(LINK_ALLREDUCE, ars, provenance=_provenance(a, a.zone, "", peer=b))


def _provenance(vm: Vm, zone: str, run_id: str, peer: Vm | None = None) -> Provenance:

    info = {"vm": vm.vm_id, "zone": zone, "gpu_type": vm.gpu_type, "run": run_id or vm.run_id}
    if peer is not None:
        info.update(peer_vm=peer.vm_id, peer_zone=peer.zone, peer_gpu_type=peer.gpu_type)
    return Provenance(source="sailor-profile-on-vm", host=vm.vm_id, recorded_at=datetime.now(UTC),
                      settings=json.dumps(info, sort_keys=True))


def measure_zone_link(params: SailorParams, src: tuple[str, str | None], dst: tuple[str, str | None],
                      log: Log, *, deps: RentingDeps, run_id: str) -> ZoneLink:
    """`sailor profile network --from ZONE[:TYPE] --to ZONE[:TYPE]`: the link between two zones, measured by
    hand on VMs of `params.provider` (on `params.scenario` for the local testbed) as the profile subflow does.

    Rents the cheapest VM at each end (of the type where given), runs `sailor profile link` on both
    (`_measure_pair`), writes the fit to `params.store_uri` for every device-type pair of the two zones the
    provider offers (only the named type at an end that names one), and removes everything it started:
    the VMs, the controller, the testbed's object store, also on an error or Ctrl-C. Returns what it wrote.
    `deps`: the run's side effects (flows/sailor.default_deps(params, run_id)).
    """
    assert deps.state is not None  # default_deps always sets the run's state
    controller = None
    try:
        offers = [o for o in deps.provider.offerings(regions=params.regions) if o.gpus > 0]
        types = [_offered_types(offers, zone, gpu, end) for (zone, gpu), end in ((src, "--from"), (dst, "--to"))]
        code = ship_code(deps.state, deps.provider.name, ship=deps.ship_wheel)
        controller = Controller(host=deps.controller_host)
        remote = VmCommands(deps.provider, controller, deps.state, code, run_id)
        log.info("renting a VM in %s and one in %s (run %s)", src[0], dst[0], run_id)
        got = _measure_pair(_VmPool(remote, offers, log), remote, src, dst)
        if got is None:
            raise SailorError(f"no two VMs could be rented in {src[0]} and {dst[0]} (a zone needs two VMs to measure "
                              f"a link inside it); to fix: try again when capacity is back, or name other zones")
        measured, allreduce, a, b = got
        combos = [((src[0], ga), (dst[0], gb)) for ga in types[0] for gb in types[1]]
        _import_links(measured, allreduce, deps.store, combos, a, b)
        return ZoneLink(run_id=run_id, link=measured, vms=[a.vm_id, b.vm_id], store=deps.store.uri,
                        rows=[f"{za}:{ga} <-> {zb}:{gb}" for (za, ga), (zb, gb) in combos])
    finally:
        if controller is not None:
            controller.close()
        deps.provider.cleanup(run_id)  # every VM of the run and its testbed; plain calls: no Prefect server
        for close in deps.closers:
            close()


def _offered_types(offers: Sequence[Capacity], zone: str, gpu: str | None, end: str) -> list[str]:
    """The device types an end of a link stands for: the one named, else every type offered in its zone."""
    here = sorted({o.gpu_type for o in offers if o.zone == zone})
    if not here:
        zones = sorted({o.zone for o in offers})
        raise SailorError(f"{end} {zone}: the provider offers no VM there now; to fix: one of {', '.join(zones)}")
    if gpu is not None and gpu not in here:
        raise SailorError(f"{end} {zone}:{gpu}: the provider offers no {gpu} there now; to fix: one of "
                          f"{', '.join(f'{zone}:{g}' for g in here)}")
    return [gpu] if gpu is not None else here


@flow(name="profile", log_prints=True)
def profile(store: ProfileStore, model: str, gpu_types: list[str], mbs: list[int] | None = None, *,
            offers: Sequence[Capacity] = (), remote: VmCommands | None = None) -> ProfileBook:
    """See the module contract; with `remote` (tasks/remote.VmCommands) missing profiles of rentable
    device types and links between offered zones are measured on rented VMs."""
    log = get_run_logger()
    ensure_model(store, model)
    on_vms = False
    if remote is not None and offers:
        types, pairs, multi = _missing(store, model, [g for g in gpu_types if g != LOCAL_GPU], offers)
        if types or pairs or multi:
            measured = profile_on_vms(store, model, types, pairs, multi, offers, remote)
            log.info("measured on rented VMs: %s", measured)
            on_vms = True
    book = load_book(store, model, gpu_types)
    missing = [g for g in gpu_types if not book.profiled_points(g)]
    elsewhere = [g for g in missing if g != LOCAL_GPU]
    if elsewhere:
        raise MissingProfileError(
            f"the store has no layer profiles of {model} on {elsewhere}",
            fix=f"run `sailor profile model --model {model} --device cuda` on a machine with that GPU type "
            f"(--store pointing at this store), or restrict gpu_types to {sorted(set(gpu_types) - set(elsewhere))}",
            kind="layers", model=model, gpu_type=elsewhere[0] if len(elsewhere) == 1 else None,
        )
    if LOCAL_GPU in missing:
        log.info(
            "profiling %s on this machine's CPU (mbs %s): the store has no cpu profile yet", model, mbs or [1, 2, 4]
        )
        profile_layers(store, model, mbs or [1, 2, 4])
    if LOCAL_GPU in gpu_types and not _has_local_link(book):
        log.info("profiling the network between two local workers: the store has no cpu link yet")
        profile_network(store)
    if missing or (LOCAL_GPU in gpu_types and not _has_local_link(book)):
        book = load_book(store, model, gpu_types)
    elif not on_vms:
        log.info("profiles of %s on %s and the links between the offered zones are in the store; nothing to "
                 "measure", model, list(gpu_types))
    return book
