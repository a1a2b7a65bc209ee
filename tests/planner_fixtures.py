"""Small synthetic profile books for planner tests: few layers, random but plausible profiles.

Every value is made up (seeded), so tests can build many different small worlds in which an
exhaustive search is affordable. They go through the same ProfileBook -> simulator path as the
published data.
"""

from __future__ import annotations

import random

from sailor_core.domain import (
    GIB,
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
    ResourcePool,
    default_region,
)
from sailor_core.planner import Objective, PlanRequest, SearchOptions
from sailor_core.profiles import ProfileBook

MODEL = "tiny"
# Links between zones of two regions (zone "r1-a" is in region "r1") run at this share of a link
# between zones of one region, and their egress costs twice as much: geo-distributed pools.
CROSS_REGION_SPEED = 0.25


def tiny_book(seed: int, *, num_blocks: int = 4, gpus: tuple[str, ...] = ("fast", "slow"),
              zones: tuple[str, ...] = ("r1-a", "r1-b"), memory_gib: tuple[float, ...] = (6.0, 3.0),
              tps: tuple[int, ...] = (1, 2)) -> ProfileBook:
    rng = random.Random(seed)
    n_layers = num_blocks + 2
    layers = []
    for tp in tps:
        for i in range(n_layers):
            kind = "embedding" if i == 0 else "head" if i == n_layers - 1 else "block"
            params = int(rng.uniform(20e6, 60e6) / tp) if kind == "block" else int(30e6 / tp)
            layers.append(LayerSpec(index=i, kind=kind, tp=tp, params=params, act_output_elems=1_000_000,
                                    act_input_elems=1_000_000, act_memory_bytes=int(rng.uniform(50e6, 150e6) / tp)))
    model = ModelSpec(name=MODEL, num_blocks=num_blocks, hidden_size=512, num_heads=8, sequence_length=1024,
                      vocab_size=1000, layers=tuple(layers))
    gpu_types = {
        g: GpuType(name=g, memory_bytes=int(mem * GIB), gpus_per_node=2)
        for g, mem in zip(gpus, memory_gib, strict=True)
    }
    speed = {g: rng.uniform(1.0, 1.3) * (1 + 1.5 * k) for k, g in enumerate(gpus)}
    base = [rng.uniform(0.004, 0.012) for _ in range(n_layers)]
    profiles: dict[tuple[str, int, int], tuple[LayerProfile, ...]] = {}
    for g in gpus:
        for mbs in (1, 2, 4):
            for tp in tps:
                rows = []
                for i in range(n_layers):
                    f = base[i] * speed[g] * mbs ** 0.85 / tp ** 0.8
                    rows.append(LayerProfile(model=MODEL, gpu_type=g, mbs=mbs, tp=tp, layer=i, forward_s=f,
                                             backward_s=2 * f, optimizer_s=0.004 * speed[g] / tp))
                profiles[(g, mbs, tp)] = tuple(rows)
    links = []
    for za in zones:
        for zb in zones:
            for ga in gpus:
                for gb in gpus:
                    for cnt in (1, 2):
                        gbps = (rng.uniform(8, 12) if za == zb else rng.uniform(2, 4)) * cnt
                        if default_region(za) != default_region(zb):
                            gbps *= CROSS_REGION_SPEED
                        links.append(NetworkLink(sender_zone=za, sender_gpu=ga, sender_count=cnt, receiver_zone=zb,
                                                 receiver_gpu=gb, receiver_count=cnt,
                                                 fit=BandwidthFit(coeffs=(0.0, 0.0, gbps), max_bytes_per_s=gbps * 1e9)))
    intra = [IntraNodeLink(gpu_type=g, num_gpus=2, fit=BandwidthFit(coeffs=(0.0, 0.0, 80.0), max_bytes_per_s=80e9))
             for g in gpus]
    egress = [
        EgressPrice(sender_zone=a, receiver_zone=b,
                    usd_per_gb=0.0 if a == b else 0.01 if default_region(a) == default_region(b) else 0.02)
        for a in zones for b in zones
    ]
    price = {g: 3.0 / (1 + k) for k, g in enumerate(gpus)}
    prices = [GpuPrice(cloud="gcp", zone=z, gpu_type=g, market=Market.ON_DEMAND, usd_per_gpu_hour=price[g])
              for z in zones for g in gpus]
    return ProfileBook(model=model, gpu_types=gpu_types, layer_profiles=profiles,
                       framework_overhead_bytes={g: 1 * GIB for g in gpus}, links=tuple(links), intra_node=tuple(intra),
                       egress=tuple(egress), prices=tuple(prices))


ZONES_2R = ("r1-a", "r1-b", "r2-a", "r2-b")


def multi_region_world(seed: int, *, num_blocks: int = 2, gbs: int = 8, max_stages: int = 3,
                       slow_share: float = 0.0) -> tuple[ProfileBook, PlanRequest]:
    """A tiny model in four zones of two regions (links across regions at a quarter of those across
    zones of one region): the fast GPU in every zone, 2 or 4 of them, prices equal or 10 % apart, and
    the slow one too in a zone with probability `slow_share` (0: one GPU type). A stage may span the
    zones of its region, and a pipeline cross zones and regions."""
    book = tiny_book(seed, num_blocks=num_blocks, zones=ZONES_2R)
    rng = random.Random(seed)
    entries = []
    for zone in ZONES_2R:
        for gpu in ("fast", "slow"):
            if gpu == "slow" and rng.random() >= slow_share:
                continue
            base = book.price_usd_per_gpu_hour(zone, gpu, Market.ON_DEMAND) or 3.0
            entries.append(Capacity(zone=zone, region=zone[:2], gpu_type=gpu, gpus=rng.choice((2, 4)),
                                     gpus_per_vm=2, usd_per_gpu_hour=round(base * rng.choice((1.0, 1.0, 1.1)), 3)))
    objective = (Objective.MAX_THROUGHPUT, Objective.MIN_COST, Objective.MIN_COST_PER_TOKEN)[seed % 3]
    return book, PlanRequest(model=MODEL, global_batch_size=gbs, pool=ResourcePool(entries=tuple(entries)),
                             objective=objective, options=SearchOptions(max_stages=max_stages))
