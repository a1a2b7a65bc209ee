"""The place step: which zones each stage's replicas go to.

Contract: `place(slots, sketch)` is a pure function: the layout of every stage (its (zone,
replicas) list, pipeline order) when the sketch's D replicas per stage fill its slots' zones, or
None when they do not fit. Stage-major (`STAGE_MAJOR`): each stage fills its slot's zones on its
own, starting at the sketch's zone rotation (default: the largest zone). Pipeline-major
(`PIPELINE_MAJOR`): zone by zone, as many whole pipelines as fit first (their sends stay inside a
zone), the rest stage-major. `fill_variants` lists the other fills of a sketch worth estimating;
`leftover` is what a placed sketch leaves of the slots, `place_in_turn` places several groups of
pipelines one after the other, and `stages_of` turns placed groups into the plan's stages. The
search, the leftover and group planners, the frontier, materialisation and the brute-force oracle
all place with these.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

from sailor_core.domain import Market, Replica, Stage
from sailor_core.planner.slots import Layout, Slot
from sailor_core.planner.space import PIPELINE_MAJOR, STAGE_MAJOR, Sketch


def place(slots: Sequence[Slot], sk: Sketch) -> tuple[Layout, ...] | None:
    """Place each stage's D replicas in its slot's zones (see `Sketch.placement`), pipeline order."""
    free = {i: [n for _, n in slots[i].zones] for i in {g for g, _ in sk.kinds}}  # the slots the sketch uses
    lays: list[list[tuple[str, int]]] = [[] for _ in sk.kinds]
    need = sk.dp
    if sk.placement == PIPELINE_MAJOR:
        need -= _whole_pipelines(slots, sk, free, lays)
    for s, (slot_i, tp) in enumerate(sk.kinds):
        slot = slots[slot_i]
        left = need
        nz = len(slot.zones)
        rot = sk.zone_rot[slot_i] if sk.zone_rot else 0
        for zi in [(rot + i) % nz for i in range(nz)]:
            if left == 0:
                break
            can = slot.usable(free[slot_i][zi], tp) // tp
            take = min(can, left)
            if take:
                lays[s].append((slot.zones[zi][0], take))
                free[slot_i][zi] -= take * tp
                left -= take
        if left:
            return None
    return tuple(tuple(lay) for lay in lays)


def _zone_order(slots: Sequence[Slot], sk: Sketch) -> list[str]:
    """The zones to fill whole pipelines in: stage 0's slot's fill order, then any other stage's zones."""
    g0 = sk.kinds[0][0]
    nz = len(slots[g0].zones)
    rot = sk.zone_rot[g0] if sk.zone_rot else 0
    order = [slots[g0].zones[(rot + i) % nz][0] for i in range(nz)]
    for g, _ in sk.kinds:
        order += [z for z, _ in slots[g].zones if z not in order]
    return order


def _whole_pipelines(slots: Sequence[Slot], sk: Sketch, free: dict[int, list[int]],
                     lays: list[list[tuple[str, int]]]) -> int:
    """Zone by zone, as many whole pipelines as fit there; takes them from `free`, adds them to `lays`."""
    index = [{z: i for i, (z, _) in enumerate(slots[g].zones)} for g, _ in sk.kinds]
    placed = 0
    for zone in _zone_order(slots, sk):
        if placed == sk.dp:
            break
        if any(zone not in ix for ix in index):
            continue

        def room(k: int, zone: str = zone) -> dict[tuple[int, int], int] | None:
            """GPUs left per (slot, zone index) after k more whole pipelines in `zone`; None if they do not fit."""
            left: dict[tuple[int, int], int] = {}
            for s, (g, tp) in enumerate(sk.kinds):
                key = (g, index[s][zone])
                f = left.get(key, free[g][key[1]])
                if slots[g].usable(f, tp) // tp < k:
                    return None
                left[key] = f - k * tp
            return left

        lo, hi = 0, sk.dp - placed  # the largest k with room(k): room is monotone in k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if room(mid) is None:
                hi = mid - 1
            else:
                lo = mid
        if lo == 0:
            continue
        for (g, zi), f in (room(lo) or {}).items():
            free[g][zi] = f
        for lay in lays:
            lay.append((zone, lo))
        placed += lo
    return placed


def leftover(slots: Sequence[Slot], sk: Sketch, layouts: Sequence[Layout]) -> tuple[Slot, ...]:
    """The slots less the GPUs this placed sketch uses: what a further group of pipelines may take."""
    used: dict[tuple[int, str], int] = {}
    for (si, tp), lay in zip(sk.kinds, layouts, strict=True):
        for zone, n in lay:
            used[(si, zone)] = used.get((si, zone), 0) + n * tp
    return tuple(s.minus({z: n for (si, z), n in used.items() if si == s.index}) for s in slots)


def place_in_turn(slots: Sequence[Slot], sketches: Sequence[Sketch]) -> list[tuple[Sketch, tuple[Layout, ...]]] | None:
    """Each sketch's pipelines placed on what the earlier ones left; None when one does not fit."""
    placed = []
    for sk in sketches:
        lay = place(slots, sk)
        if lay is None:
            return None
        placed.append((sk, lay))
        slots = leftover(slots, sk, lay)
    return placed


def stages_of(slots: Sequence[Slot], bounds: Sequence[tuple[int, int]],
              placed: Sequence[tuple[Sketch, Sequence[Sequence[tuple[str, int]]]]]) -> tuple[Stage, ...]:
    """The plan's stages: stage s holds every placed group's stage-s replicas, group by group, each TP
    group on the cheapest market of its zone that has room (pooled slots, `Slot.replicas`)."""
    stages = []
    free: dict[tuple[str, Market], int] = {}  # GPUs left per (zone, market) of pooled slots
    for s, (first, last) in enumerate(bounds):
        reps: list[Replica] = []
        for sk, lay in placed:
            si, tp = sk.kinds[s]
            for zone, k in lay[s]:
                reps.extend(slots[si].replicas(zone, tp, k, free))
        stages.append(Stage(first_layer=first, last_layer=last, replicas=tuple(reps)))
    return tuple(stages)


def fill_variants(slots: Sequence[Slot], sk: Sketch) -> Iterator[Sketch]:
    """The sketch with each other zone of a slot it uses filled first, stage-major and (with several
    stages) whole pipelines per zone first: zones of a region differ in their measured links, and
    whole pipelines per zone are as fast where compute is the bottleneck without paying egress for
    every microbatch sent across zones."""
    used = sorted({si for si, _ in sk.kinds})
    placements = (STAGE_MAJOR, PIPELINE_MAJOR) if sk.num_stages > 1 else (STAGE_MAJOR,)
    for placement in placements:
        if placement == PIPELINE_MAJOR:
            yield replace(sk, zone_rot=(), placement=placement)
        for si in used:
            for r in range(1, len(slots[si].zones)):
                rot = [0] * len(slots)
                rot[si] = r
                yield replace(sk, zone_rot=tuple(rot), placement=placement)
