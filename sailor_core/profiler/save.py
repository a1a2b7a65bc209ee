"""Land profiler results in a profile store, and the one-call entry points the flow's tasks use.

Contract: the store is passed in (a `profiles_store.ProfileStore` or anything with its methods);
this module never opens one and names its tables by name (`store.write("network_links", ...)`), so
sailor_core does not depend on the store's package.
- `save_model_profile(store, profile)`: makes sure the store knows the GPU type and the model's
  layer sizes (writes the analytic spec of sailor_core.models if the model is missing, adds TP
  degrees it lacks, refuses a stored model of the same name with another architecture), then
  replaces the (model, GPU type) layer profile in one atomic commit and records the framework
  overhead. Every write carries the profile's provenance. Called only with a complete profile, so an
  interrupted or failed profile writes nothing; a reader sees the old profile until the replace
  commits (the store's contract).
- `save_network_profile(store, profile)`: upserts the measured link, its intra-node twin and the
  node's measured all-reduce.
- `profile_model_to_store(store, model=..., ...)` / `profile_network_to_store(store, ...)`: measure
  then save; the same code as `sailor profile model|network`. They return the rows written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sailor_core.domain import ModelSpec
from sailor_core.errors import SailorError
from sailor_core.models.config import get_config, model_spec
from sailor_core.profiler.env import device_gpu_type
from sailor_core.profiler.layers import ModelProfile, ModelProfileSettings, profile_model
from sailor_core.profiler.network import NetworkProfile, NetworkSettings, profile_network

_ARCH = ("num_blocks", "hidden_size", "num_heads", "sequence_length", "vocab_size", "ffn_hidden_size")


def _spec_to_write(store: Any, profile: ModelProfile) -> ModelSpec | None:
    """The spec the store should hold after this profile, or None when it already does."""
    analytic = model_spec(get_config(profile.model))  # every TP degree the model splits into
    if profile.model not in store.model_names():
        return analytic
    stored = store.model(profile.model)
    differs = [
        f"{a} {getattr(stored, a)} != {getattr(analytic, a)}"
        for a in _ARCH
        if getattr(stored, a) != getattr(analytic, a)
    ]
    if differs:
        raise SailorError(
            f"the store holds a different model named {profile.model} ({', '.join(differs)}); its profiles "
            f"would not describe this one; to fix: profile into another store (--store) or remove that model"
        )
    missing = sorted({p.tp for p in profile.profiles} - set(stored.tp_degrees))
    if not missing:
        return None  # keep the stored sizes (e.g. the artifact's measured ones for its models)
    extra = tuple(ly for ly in analytic.layers if ly.tp in missing)
    return ModelSpec(**{a: getattr(stored, a) for a in ("name", *_ARCH)}, layers=stored.layers + extra,
                     tied_head=stored.tied_head)


def save_model_profile(store: Any, profile: ModelProfile) -> int:
    if profile.gpu_type not in store.gpu_types():
        store.write("gpu_types", [device_gpu_type(profile.device, profile.gpu_type)], provenance=profile.provenance)
    spec = _spec_to_write(store, profile)
    if spec is not None:
        store.write("model_layers", [spec], provenance=profile.provenance)
    n = store.replace_layer_profiles(profile.model, profile.gpu_type, profile.profiles, provenance=profile.provenance)
    if profile.framework_overhead_bytes > 0:
        store.write("framework_overhead", [(profile.gpu_type, profile.framework_overhead_bytes)],
                    provenance=profile.provenance)
    return int(n)


def save_network_profile(store: Any, profile: NetworkProfile) -> int:
    store.write("network_links", [profile.link], provenance=profile.provenance)
    store.write("intra_node_links", [profile.intra_node], provenance=profile.provenance)
    store.write("node_allreduce", [profile.node_allreduce], provenance=profile.provenance)
    return 3


def _ints(values: Iterable[int] | None, default: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(v) for v in values) if values is not None else default


def profile_model_to_store(
    store: Any,
    *,
    model: str,
    device: str = "cpu",
    mbs: Iterable[int] | None = None,
    tp: Iterable[int] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    **settings: Any,
) -> int:
    """Profile `model` on this machine and replace its profile in `store`; returns layer rows written."""
    s = ModelProfileSettings(model=model, device=device, mbs=_ints(mbs, (1, 2, 4)), tp=_ints(tp, (1,)), **settings)
    return save_model_profile(store, profile_model(s, progress))


def profile_network_to_store(
    store: Any, *, workers: int = 2, progress: Callable[[dict[str, Any]], None] | None = None, **settings: Any
) -> int:
    """Profile the network between `workers` local workers and upsert the link; returns links written."""
    if workers < 2:
        raise SailorError(f"the network profiler needs at least 2 workers, got {workers}")
    return save_network_profile(store, profile_network(NetworkSettings(workers=workers, **settings), progress))
