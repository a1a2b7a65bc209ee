"""The `profile` subflow: make sure the store holds what planning needs for a model on a set of GPUs.

Contract: `profile(store, model, gpu_types)` returns the store's ProfileBook for the model on those
GPU types after measuring what is missing. Present profiles are read, never re-measured. Missing
ones are measured on this machine when it is the machine they describe (GPU type `cpu`: the local
provider's slots) with the profiler of sailor_core (the same code as `sailor profile model` and
`sailor profile network`), and written to the store with provenance. A missing profile for a GPU
type this machine does not have fails with the command to run on such a machine: profiling on
rented cloud VMs before planning is not implemented yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from sailor_core.domain import SailorError
from sailor_core.profiles import MissingProfileError, ProfileBook

LOCAL_GPU = "cpu"
LOCAL_ZONE = "local"


@task(name="load-profiles", retries=3, retry_delay_seconds=[1, 2, 5], cache_policy=NO_CACHE,
      retry_condition_fn=lambda t, r, s: not isinstance(_exc(s), SailorError))
def load_book(store: Any, model: str, gpu_types: Sequence[str]) -> ProfileBook:
    return store.profile_book(model, sorted(set(gpu_types)))


def _exc(state: Any) -> BaseException | None:
    try:
        state.result()
    except BaseException as e:
        return e
    return None


@task(name="ensure-model-spec", retries=2, cache_policy=NO_CACHE)
def ensure_model(store: Any, model: str) -> None:
    """Models the store lacks but the model family defines (gpt-tiny, gpt-small) are written to it."""
    if model in store.model_names():
        return
    from sailor_core.models.config import get_config, model_spec

    store.write_model(model_spec(get_config(model)))


@task(name="profile-layers", cache_policy=NO_CACHE)
def profile_layers(store: Any, model: str, mbs: Sequence[int]) -> int:
    """sailor_core.profiler.layers on this machine's CPU; the whole profile is written in one commit."""
    from sailor_core.profiler.layers import ModelProfileSettings, profile_model

    prof = profile_model(ModelProfileSettings(model=model, device="cpu", mbs=tuple(mbs), tp=(1,)))
    store.replace_layer_profiles(model, prof.gpu_type, prof.profiles, provenance=prof.provenance)
    store.write_framework_overhead({prof.gpu_type: prof.framework_overhead_bytes}, provenance=prof.provenance)
    return len(prof.profiles)


@task(name="profile-network", cache_policy=NO_CACHE)
def profile_network(store: Any) -> int:
    """sailor_core.profiler.network between two local workers: the cpu link and its all-reduce fit."""
    from sailor_core.profiler.network import NetworkSettings
    from sailor_core.profiler.network import profile_network as measure

    prof = measure(NetworkSettings(workers=2, device="cpu", zone=LOCAL_ZONE))
    store.write_network_links([prof.link], provenance=prof.provenance)
    store.write_intra_node_links([prof.intra_node], provenance=prof.provenance)
    return len(prof.points)


def _has_local_link(book: ProfileBook) -> bool:
    return book.link(LOCAL_ZONE, LOCAL_GPU, 1, LOCAL_ZONE, LOCAL_GPU, 1) is not None or \
        book.intra_node_link(LOCAL_GPU, 2) is not None


@flow(name="profile", log_prints=True)
def profile(store: Any, model: str, gpu_types: list[str], mbs: list[int] | None = None) -> ProfileBook:
    log = get_run_logger()
    ensure_model(store, model)
    book = load_book(store, model, gpu_types)
    missing = [g for g in gpu_types if not book.profiled_points(g)]
    remote = [g for g in missing if g != LOCAL_GPU]
    if remote:
        raise MissingProfileError(
            f"the store has no layer profiles of {model} on {remote}; to fix: run "
            f"`sailor profile model --model {model} --device cuda` on a machine with that GPU type "
            f"(--store pointing at this store), or restrict gpu_types to {sorted(set(gpu_types) - set(remote))}"
        )
    if LOCAL_GPU in missing:
        log.info("profiling %s on this machine's CPU (mbs %s): the store has no cpu profile yet", model, mbs or [1, 2, 4])
        profile_layers(store, model, mbs or [1, 2, 4])
    if LOCAL_GPU in gpu_types and not _has_local_link(book):
        log.info("profiling the network between two local workers: the store has no cpu link yet")
        profile_network(store)
    if missing or (LOCAL_GPU in gpu_types and not _has_local_link(book)):
        book = load_book(store, model, gpu_types)
    else:
        log.info("profiles of %s on %s are in the store; nothing to measure", model, list(gpu_types))
    return book
