"""Reader for the data published with the Sailor artifact (eth-easl/sailor, MIT), laid out as in its repo.

Contract: `read_eth_easl(root)` parses the JSON files under `root` (the folder holding `sailor/`)
into domain values; it does no other I/O and writes nothing. `EthEaslData.profile_book(model)`
bundles them for the simulator. Formats are described in docs/formats.md.

Where the published files disagree (profiles under Planner/sailor_planner/profiles against
Planner/simulations/profiles_tmp.json), the simulator's file `profiles_tmp.json` wins for every
(model, GPU type) it covers: it is the one that reproduces the measured validation runs, and it
has the correct 34-layer GPT-Neo-2.7/GH-96 profile where the planner's file is a copy of OPT-350's.
The planner's files fill in the pairs it lacks (OPT-30/GH-96). `LAYER_PROFILE_CHOICE` records this.
Network links likewise: multizone_bandwidths_het.json (what the simulator and planner read) wins, and
multizone_bandwidths.json adds only the links it lacks (`NETWORK_CHOICE`; no key disagrees).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from sailor_core.catalog import GPU_TYPES, MODEL_ARCHITECTURES
from sailor_core.domain import (
    BandwidthFit,
    Capacity,
    EgressPrice,
    GpuPrice,
    GpuType,
    IntraNodeLink,
    LayerProfile,
    LayerSpec,
    Market,
    ModelSpec,
    NetworkLink,
)
from sailor_core.errors import SailorError
from sailor_core.profiles import ProfileBook

SOURCE = "eth-easl/sailor@cf2c8e3c (MIT, ETH Zurich)"
LAYER_PROFILE_CHOICE = (
    "layer profiles: Planner/simulations/profiles_tmp.json where it has the (model, GPU type), else "
    "Planner/sailor_planner/profiles/<model>/<gpu>/profile.json; profiles_tmp.json reproduces the "
    "measured validation runs and has the correct GPT-Neo-2.7/GH-96 profile"
)
NETWORK_CHOICE = (
    "network links: sailor/providers/multizone_bandwidths_het.json, plus the links only "
    "sailor/providers/multizone_bandwidths.json has (no key is in both with different values)"
)
# GPU prices the artifact's evaluation used (hard-coded in its simulator), on-demand, every zone.
EVALUATION_PRICES_USD_PER_GPU_HOUR = {"A100-40": 3.673385, "V100-16": 2.859998, "GH-96": 11.06}
ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f", "us-west1-b")
PRICES_FETCHED_AT = datetime(2025, 6, 1, tzinfo=UTC)  # the artifact's snapshot; no fetch time is published


@dataclass(frozen=True, kw_only=True)
class EthEaslData:
    models: dict[str, ModelSpec]
    gpu_types: dict[str, GpuType]
    layer_profiles: tuple[LayerProfile, ...]
    layer_profile_files: dict[tuple[str, str], str]  # (model, gpu) -> file it came from
    links: tuple[NetworkLink, ...]
    # (sender zone, GPU, count, receiver zone, GPU, count) -> file it came from
    link_files: dict[tuple[str, str, int, str, str, int], str]
    cluster_config_gpus: frozenset[str]  # GPU types whose memory/shape came from the cluster config
    intra_node: tuple[IntraNodeLink, ...]
    egress: tuple[EgressPrice, ...]
    prices: tuple[GpuPrice, ...]
    quotas: tuple[Capacity, ...]

    def profile_book(self, model: str) -> ProfileBook:
        if model not in self.models:
            raise SailorError(f"unknown model {model!r}; the published data has {sorted(self.models)}")
        grouped: dict[tuple[str, int, int], list[LayerProfile]] = {}
        for p in self.layer_profiles:
            if p.model == model:
                grouped.setdefault((p.gpu_type, p.mbs, p.tp), []).append(p)
        return ProfileBook(
            model=self.models[model],
            gpu_types=self.gpu_types,
            layer_profiles={k: tuple(sorted(v, key=lambda x: x.layer)) for k, v in grouped.items()},
            links=self.links,
            intra_node=self.intra_node,
            egress=self.egress,
            prices=self.prices,
        )


def _load(path: Path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise SailorError(
            f"{path} is missing; to fix: point at a folder laid out as the eth-easl/sailor repository "
            f"(it must contain sailor/Planner/llm_info.json)"
        ) from None
    except json.JSONDecodeError as e:
        raise SailorError(f"{path} is not valid JSON ({e}); to fix: restore the file from the artifact") from None


def _fit(leaf: list) -> BandwidthFit:
    coeffs, max_bw = leaf
    return BandwidthFit(coeffs=(float(coeffs[0]), float(coeffs[1]), float(coeffs[2])), max_bytes_per_s=float(max_bw))


def _models(llm_info: dict) -> dict[str, ModelSpec]:
    out = {}
    for name, by_tp in llm_info.items():
        arch = MODEL_ARCHITECTURES.get(name)
        n_layers = len(next(iter(by_tp.values())))
        if arch is None:  # an unknown model in a user's import: infer what the sizes allow
            arch = dict(num_blocks=n_layers - 2, hidden_size=1, num_heads=1, sequence_length=1, vocab_size=1)
        layers = []
        for tp, recs in by_tp.items():
            for idx, r in recs.items():
                i = int(idx)
                kind = "embedding" if i == 0 else "head" if i == n_layers - 1 else "block"
                layers.append(
                    LayerSpec(
                        index=i,
                        kind=kind,
                        tp=int(tp),
                        params=int(r["params_floats"]),
                        act_output_elems=int(r["act_output_floats"]),
                        act_input_elems=int(r["act_input_floats"]),
                        act_memory_bytes=int(r["act_mem_bytes"]),
                    )
                )
        out[name] = ModelSpec(  # tied_head: the data does not say (False)
            name=name, layers=tuple(layers), num_blocks=arch["num_blocks"], hidden_size=arch["hidden_size"],
            num_heads=arch["num_heads"], sequence_length=arch["sequence_length"], vocab_size=arch["vocab_size"],
            ffn_hidden_size=arch.get("ffn_hidden_size", 0),
        )
    return out


def _profile_records(model: str, gpu: str, tree: dict, source_file: str) -> Iterator[LayerProfile]:
    for mbs, by_tp in tree.items():
        for tp, by_layer in by_tp.items():
            for layer, (fwd, bwd, upd) in by_layer.items():
                yield LayerProfile(
                    model=model, gpu_type=gpu, mbs=int(mbs), tp=int(tp), layer=int(layer),
                    forward_s=float(fwd), backward_s=float(bwd), optimizer_s=float(upd),
                )


def read_eth_easl(root: str | os.PathLike[str]) -> EthEaslData:
    """Parses the artifact's JSON files under `root` (or its eth-easl-sailor/ folder) into domain values."""
    base = Path(root)
    if (base / "eth-easl-sailor").is_dir():
        base = base / "eth-easl-sailor"
    sailor = base / "sailor"
    planner = sailor / "Planner"
    providers = sailor / "providers"
    models = _models(_load(planner / "llm_info.json"))
    profiles, files = _layer_profiles(planner)
    gpu_types, from_cluster = _gpu_types(planner)
    links, link_files = _network_links(providers)
    intra = [
        IntraNodeLink(gpu_type=g, num_gpus=int(n), fit=_fit(leaf))
        for g, by_n in _load(providers / "intra_node_bandwidths.json").items()
        for n, leaf in by_n.items()
    ]
    egress = [
        EgressPrice(sender_zone=s, receiver_zone=r, usd_per_gb=float(v))
        for s, by_r in _load(providers / "gcp" / "communication_cost.json").items()
        for r, v in by_r.items()
    ]
    zones = sorted({lk.sender_zone for lk in links} | set(ZONES))
    prices = [
        GpuPrice(
            cloud="gcp", zone=z, gpu_type=g, market=Market.ON_DEMAND, usd_per_gpu_hour=p, fetched_at=PRICES_FETCHED_AT
        )
        for g, p in EVALUATION_PRICES_USD_PER_GPU_HOUR.items()
        for z in zones
    ]
    return EthEaslData(
        models=models,
        gpu_types=gpu_types,
        layer_profiles=tuple(profiles),
        layer_profile_files=files,
        links=tuple(links),
        link_files=link_files,
        cluster_config_gpus=frozenset(from_cluster),
        intra_node=tuple(intra),
        egress=tuple(egress),
        prices=tuple(prices),
        quotas=tuple(_quotas(planner, gpu_types)),
    )


def _layer_profiles(planner: Path) -> tuple[list[LayerProfile], dict[tuple[str, str], str]]:
    """(every layer profile, the file each (model, GPU type) came from): the simulator's file first,
    the planner's per-pair files only for the pairs it lacks (see LAYER_PROFILE_CHOICE)."""
    sim_profiles_path = planner / "simulations" / "profiles_tmp.json"
    sim_profiles = _load(sim_profiles_path) if sim_profiles_path.exists() else {}
    profiles: list[LayerProfile] = []
    files: dict[tuple[str, str], str] = {}
    for model, by_gpu in sim_profiles.items():
        for gpu, tree in by_gpu.items():
            files[(model, gpu)] = "sailor/Planner/simulations/profiles_tmp.json"
            profiles.extend(_profile_records(model, gpu, tree, files[(model, gpu)]))
    prof_dir = planner / "sailor_planner" / "profiles"
    if prof_dir.is_dir():
        for model_dir in sorted(prof_dir.iterdir()):
            for gpu_dir in sorted(model_dir.iterdir()) if model_dir.is_dir() else ():
                key = (model_dir.name, gpu_dir.name)
                if key in files or not (gpu_dir / "profile.json").exists():
                    continue
                files[key] = f"sailor/Planner/sailor_planner/profiles/{key[0]}/{key[1]}/profile.json"
                profiles.extend(_profile_records(*key, _load(gpu_dir / "profile.json"), files[key]))
    return profiles, files


def _gpu_types(planner: Path) -> tuple[dict[str, GpuType], set[str]]:
    """(the catalog's GPU types with memory and node size from the cluster config, the names it set)."""
    gpu_types = dict(GPU_TYPES)
    from_cluster: set[str] = set()
    cluster_path = planner / "simulations" / "configs" / "basic_cluster_config.json"
    if cluster_path.exists():
        for name, cfg in _load(cluster_path).items():
            if isinstance(cfg, dict):
                from_cluster.add(name)
                known = gpu_types.get(name)
                gpu_types[name] = GpuType(
                    name=name,
                    memory_bytes=int(cfg["mem_per_gpu"]),
                    gpus_per_node=int(cfg["gpus_per_node"]),
                    peak_flops=known.peak_flops if known else None,
                )
    return gpu_types, from_cluster


def _network_links(
    providers: Path,
) -> tuple[list[NetworkLink], dict[tuple[str, str, int, str, str, int], str]]:
    """(every zone-to-zone link, the file each came from): the heterogeneous file wins (see NETWORK_CHOICE)."""
    # Network: the heterogeneous file (the one the simulator and planner read) wins; the homogeneous
    # file only adds the links it lacks (A100-80 and some GH-96 entries; no key disagrees).
    links = []
    link_files: dict[tuple[str, str, int, str, str, int], str] = {}
    for fname in ("multizone_bandwidths_het.json", "multizone_bandwidths.json"):
        if fname != "multizone_bandwidths_het.json" and not (providers / fname).exists():
            continue
        for sz, by_sg in _load(providers / fname).items():
            for sg, by_sc in by_sg.items():
                for sc, by_rz in by_sc.items():
                    for rz, by_rg in by_rz.items():
                        for rg, by_rc in by_rg.items():
                            for rc, leaf in by_rc.items():
                                link_key = (sz, sg, int(sc), rz, rg, int(rc))
                                if link_key in link_files:
                                    continue
                                link_files[link_key] = f"sailor/providers/{fname}"
                                links.append(
                                    NetworkLink(
                                        sender_zone=sz, sender_gpu=sg, sender_count=int(sc),
                                        receiver_zone=rz, receiver_gpu=rg, receiver_count=int(rc), fit=_fit(leaf),
                                    )
                                )
    return links, link_files


def _quotas(planner: Path, gpu_types: dict[str, GpuType]) -> list[Capacity]:
    """The artifact's dummy quotas as pool entries at the evaluation prices (none when the file is absent)."""
    quotas_path = planner / "sailor_planner" / "dummy_quotas_dict.json"
    quotas = []
    if quotas_path.exists():
        for g, by_zone in _load(quotas_path).items():
            for z, n in by_zone.items():
                quotas.append(
                    Capacity(zone=z, region=z.rsplit("-", 1)[0], gpu_type=g, gpus=int(n),
                             gpus_per_vm=gpu_types[g].gpus_per_node if g in gpu_types else 1,
                             usd_per_gpu_hour=EVALUATION_PRICES_USD_PER_GPU_HOUR.get(g, 0.0))
                )
    return quotas
