"""Write data read by `eth_easl.read_eth_easl` into a ProfileStore, with per-row provenance.

Contract: `import_eth_easl(store, data, recorded_at=...)` writes every table the published data
fills (GPU types, model layers, layer profiles, network and intra-node links, egress prices, GPU
prices, quotas). Layer profiles and model layers replace their (model, GPU type) / model
partitions; the other tables are upserted by key, so importing twice changes nothing. `host`
in each row's provenance names the file of the dataset the row came from.
"""

from __future__ import annotations

from datetime import datetime

from profiles_store.eth_easl import (
    EVALUATION_PRICES_USD_PER_GPU_HOUR,
    LAYER_PROFILE_CHOICE,
    NETWORK_CHOICE,
    SOURCE,
    EthEaslData,
)
from profiles_store.store import ProfileStore
from profiles_store.tables import (
    EGRESS_PRICES,
    GPU_PRICES,
    GPU_TYPES,
    INTRA_NODE_LINKS,
    MODELS,
    NETWORK_LINKS,
    QUOTAS,
    Quota,
)
from sailor_core.domain import LayerProfile, Provenance

CATALOG_SOURCE = "sailor_core.catalog"


def import_eth_easl(
    store: ProfileStore, data: EthEaslData, *, recorded_at: datetime, source: str = SOURCE
) -> dict[str, int]:
    """Import everything; returns rows written per table."""

    def prov(host: str, settings: str = "") -> Provenance:
        return Provenance(source=source, host=host, recorded_at=recorded_at, settings=settings)

    counts: dict[str, int] = {}
    cluster = [g for n, g in sorted(data.gpu_types.items()) if n in data.cluster_config_gpus]
    others = [g for n, g in sorted(data.gpu_types.items()) if n not in data.cluster_config_gpus]
    store.write(GPU_TYPES, cluster, provenance=prov("sailor/Planner/simulations/configs/basic_cluster_config.json"))
    if others:
        store.write(GPU_TYPES,
            others, provenance=Provenance(source=CATALOG_SOURCE, host="sailor_core/catalog.py", recorded_at=recorded_at)
        )
    counts["gpu_types"] = len(data.gpu_types)

    counts["model_layers"] = 0
    for name in sorted(data.models):
        spec = data.models[name]
        store.write(MODELS, [spec], provenance=prov("sailor/Planner/llm_info.json"))
        counts["model_layers"] += len(spec.layers)

    by_pair: dict[tuple[str, str], list[LayerProfile]] = {}
    for p in data.layer_profiles:
        by_pair.setdefault((p.model, p.gpu_type), []).append(p)
    counts["layer_profiles"] = 0
    for (model, gpu), rows in sorted(by_pair.items()):
        file = data.layer_profile_files.get((model, gpu), "")
        counts["layer_profiles"] += store.replace_layer_profiles(
            model, gpu, rows, provenance=prov(file, settings=LAYER_PROFILE_CHOICE)
        )

    by_file: dict[str, list] = {}
    for lk in data.links:
        key = (lk.sender_zone, lk.sender_gpu, lk.sender_count, lk.receiver_zone, lk.receiver_gpu, lk.receiver_count)
        by_file.setdefault(data.link_files.get(key, "sailor/providers/multizone_bandwidths_het.json"), []).append(lk)
    for file, links in sorted(by_file.items()):
        store.write(NETWORK_LINKS, links, provenance=prov(file, settings=NETWORK_CHOICE))
    counts["network_links"] = len(data.links)

    store.write(INTRA_NODE_LINKS, data.intra_node, provenance=prov("sailor/providers/intra_node_bandwidths.json"))
    counts["intra_node_links"] = len(data.intra_node)
    store.write(EGRESS_PRICES, data.egress, provenance=prov("sailor/providers/gcp/communication_cost.json"))
    counts["egress_prices"] = len(data.egress)
    store.write(GPU_PRICES,
        data.prices,
        provenance=prov(
            "GPU_PRICES of the artifact's Python simulator (not a data file)",
            settings="evaluation prices, on-demand, every zone: "
            + ", ".join(f"{g} {p}" for g, p in EVALUATION_PRICES_USD_PER_GPU_HOUR.items()),
        ),
    )
    counts["gpu_prices"] = len(data.prices)
    if data.quotas:
        store.write(QUOTAS, [Quota.of(c) for c in data.quotas],
                    provenance=prov("sailor/Planner/sailor_planner/dummy_quotas_dict.json"))
    counts["quotas"] = len(data.quotas)
    return counts
