"""The cost step: a placed sketch's iteration time, price and useful fraction, by the simulator's composition.

Contract: `estimate(problem, costs, sketch, layouts)` is a pure function of its inputs (the `Costs`
protocol answers every question: the simulator's building blocks in production, synthetic costs
in tests). It composes the terms the full simulator composes, stage by stage: the 1F1B pipeline
time (`simulator.pipeline_time_s`) of the stages' compute and the slowest zone pair's sends per
boundary, each stage's gradient ring overlapped with its last backward (`simulator.dp_sync_end_s`),
the tied embedding/head exchange, the slowest optimizer step, the GPUs' price (pooled markets
cheapest first) and the egress between zones; under spot risk, the expected share of wall time
that trains (risk.py). None when the sketch does not fit its slots' zones. `linear_time` is one
pipeline's time as fill + cycle x microbatches, for the planners that balance groups of pipelines.
"""

from __future__ import annotations

from collections.abc import Sequence

from sailor_core.planner.costs import Costs, nic_share, zone_pairs
from sailor_core.planner.placement import place
from sailor_core.planner.risk import useful_fraction_of
from sailor_core.planner.slots import Layout, Slot
from sailor_core.planner.space import STAGE_MAJOR, Estimate, Problem, Sketch
from sailor_core.simulator import StageCompute, dp_sync_end_s, pipeline_time_s

SECONDS_PER_HOUR = 3600.0
BYTES_PER_GB = 1e9


def estimate(pb: Problem, costs: Costs, sk: Sketch, layouts: tuple[Layout, ...] | None = None) -> Estimate | None:
    """The sketch's estimate on these layouts (placed by `placement.place` when not given)."""
    layouts = layouts or place(pb.slots, sk)
    if layouts is None or needs_missing_link(pb.slots, costs, sk, layouts):
        return None
    slots = pb.slots
    n = pb.global_batch_size // sk.mbs
    m = -(-n // sk.dp)
    comp = stage_times(costs, slots, sk)
    p2p, egress = _sends(slots, costs, sk, layouts, n)
    total, _, finish = pipeline_time_s(comp, p2p, m, with_p2p_part=False)
    end, opt, egress = _rings(slots, costs, sk, layouts, comp, finish, egress)
    iteration = total + max(0.0, end - total) + opt
    usd_per_s = usd_per_hour(slots, sk, layouts) / SECONDS_PER_HOUR
    usd_iter = usd_per_s * iteration + egress
    return Estimate(
        iteration_s=iteration,
        usd_per_iteration=usd_iter,
        usd_per_hour=usd_iter / iteration * SECONDS_PER_HOUR,
        num_gpus=sum(tp for _, tp in sk.kinds) * sk.dp,
        layouts=layouts,
        useful_fraction=useful_fraction(pb, sk, layouts, iteration),
    )


def needs_missing_link(slots: Sequence[Slot], c: Costs, sk: Sketch, layouts: Sequence[Layout]) -> bool:
    """Whether the placement sends between two zones with no network profile between its GPUs
    (`Costs.linked`): a boundary's zone pair, or a hop between zones of a stage's gradient ring. Its
    estimate would be infinite; this says so without timing anything (on pools whose links are partly
    profiled, most sketches a search meets are such)."""
    for s in range(sk.num_stages - 1):
        a, b = slots[sk.kinds[s][0]], slots[sk.kinds[s + 1][0]]
        for za, zb, _ in zone_pairs(layouts[s], layouts[s + 1]):
            if not c.linked(a, za, b, zb):
                return True
    if sk.dp > 1:
        for (si, _), lay in zip(sk.kinds, layouts, strict=True):
            slot = slots[si]
            zones = sorted({z for z, k in lay if k > 0}, key=lambda z: (slot.region_of(z), z))
            if len(zones) > 1 and not all(c.linked(slot, z, slot, zones[(i + 1) % len(zones)])
                                          for i, z in enumerate(zones)):
                return True
    return False


def stage_times(c: Costs, slots: Sequence[Slot], sk: Sketch) -> list[StageCompute]:
    """Each stage's per-microbatch compute in its place of the pipeline (recomputing where it must)."""
    p = sk.num_stages
    return [c.stage_compute(slots[si].gpu_type, sk.mbs, tp, first, last, in_flight=p - s, first_stage=s == 0,
                            last_stage=s == p - 1)
            for s, ((first, last), (si, tp)) in enumerate(zip(sk.bounds, sk.kinds, strict=True))]


def round_trip_usd_per_gb(c: Costs, za: str, zb: str) -> float:
    """USD per GB a boundary message pays between two zones, sent one way and its gradient back the other
    (0 inside a zone): how the estimate bills pipeline sends, and what the search's egress floor reads."""
    return 0.0 if za == zb else c.egress_usd_per_gb(za, zb) + c.egress_usd_per_gb(zb, za)


def _sends(slots: Sequence[Slot], c: Costs, sk: Sketch, layouts: Sequence[Layout], n: int
           ) -> tuple[list[tuple[float, float]], float]:
    """(per boundary the slowest zone pair's (forward, back) send seconds, the egress USD of the sends)."""
    p2p: list[tuple[float, float]] = []
    egress = 0.0
    for s in range(sk.num_stages - 1):
        (sa, ta), (sb, tb) = sk.kinds[s], sk.kinds[s + 1]
        a, b = slots[sa], slots[sb]
        msg = c.boundary_bytes(ta, sk.bounds[s][1], sk.mbs)
        worst_f = worst_b = 0.0
        for za, zb, cnt in zone_pairs(layouts[s], layouts[s + 1]):
            share = nic_share(a, ta, layouts[s], za, b, tb, layouts[s + 1], zb)
            f, bk = fwd_bwd(c.p2p_s(a, ta, za, b, tb, zb, msg, share))
            worst_f, worst_b = max(worst_f, f), max(worst_b, bk)
            if za != zb:
                # each of these cnt pipelines sends about n/D microbatches each way, one message
                # per microbatch in slices (SimModel.boundary_p2p_s)
                egress += msg * (n / sk.dp) * cnt / BYTES_PER_GB * round_trip_usd_per_gb(c, za, zb)
        p2p.append((worst_f, worst_b))
    return p2p, egress


def _rings(slots: Sequence[Slot], c: Costs, sk: Sketch, layouts: Sequence[Layout], comp: Sequence[StageCompute],
           finish: Sequence[float], egress: float) -> tuple[float, float, float]:
    """(when the last gradient exchange ends, the slowest optimizer step, `egress` plus the rings' and
    the tied exchange's egress USD)."""
    ends: list[float] = []
    opt = 0.0
    for s, ((first, last), (si, tp)) in enumerate(zip(sk.bounds, sk.kinds, strict=True)):
        slot = slots[si]
        if sk.dp > 1:  # the simulator's bucket overlap with the last backward (dp_sync_end_s)
            p = sk.num_stages
            rc = c.recomputes(slot.gpu_type, tp, first, last, mbs=sk.mbs, in_flight=p - s, first_stage=s == 0,
                              last_stage=s == p - 1)
            ar, ar_last, first_bwd = c.dp_sync_terms(slot, tp, layouts[s], sk.mbs, first, last, rc)
            ends.append(dp_sync_end_s(finish[s], finish[s] - comp[s].backward_s + first_bwd, ar, ar_last))
        else:
            ends.append(finish[s])
        grads = c.grad_bytes(tp, first, last)
        opt = max(opt, c.optimizer_s(slot.gpu_type, sk.mbs, tp, first, last))
        zones = sorted({z for z, k in layouts[s] if k > 0})
        if len(zones) > 1:
            flows = max(1, min(tp, slot.gpus_per_node))
            gb = 2 * (sk.dp - 1) / sk.dp * grads * flows / BYTES_PER_GB
            for i, za in enumerate(zones):
                egress += gb * c.egress_usd_per_gb(za, zones[(i + 1) % len(zones)])
    end = max(ends)
    if sk.num_stages > 1:
        # the tied embedding/head exchange after the first and last stages' rings (simulator._tied_sync)
        (sa, ta), (sb, tb) = sk.kinds[0], sk.kinds[-1]
        tied = 0.0
        for za, zb, cnt in zone_pairs(layouts[0], layouts[-1]):
            t, gb = c.tied_sync(slots[sa], ta, za, slots[sb], tb, zb)
            tied = max(tied, t)
            if za != zb:
                egress += gb * cnt * (c.egress_usd_per_gb(za, zb) + c.egress_usd_per_gb(zb, za))
        end = max(end, max(ends[0], ends[-1]) + tied)
    return end, opt, egress


def linear_time(c: Costs, slots: Sequence[Slot], sk: Sketch, layouts: Sequence[Layout]) -> tuple[float, float]:
    """(a, b) with one pipeline's seconds = a + b x microbatches, from the simulator's 1F1B composition
    (each boundary timed between the stages' first zones): what the group planners balance pipelines by.
    The line runs through the times at 2p and 4p microbatches (p stages), past the fill: b is the
    steady cycle (the slowest stage's forward, backward and sends), a what the fill and drain add. The
    step from 1 to 2 microbatches is not the cycle: the second forward overlaps the first one's way
    down the pipeline, so a line through those two under-counts every later microbatch on unequal stages."""
    comp = stage_times(c, slots, sk)
    p2p = []
    for s in range(sk.num_stages - 1):
        (sa, ta), (sb, tb) = sk.kinds[s], sk.kinds[s + 1]
        msg = c.boundary_bytes(ta, sk.bounds[s][1], sk.mbs)
        za, zb = layouts[s][0][0], layouts[s + 1][0][0]
        p2p.append(c.p2p_s(slots[sa], ta, za, slots[sb], tb, zb, msg))
    n1, n2 = 2 * sk.num_stages, 4 * sk.num_stages
    t1 = pipeline_time_s(comp, p2p, n1, with_p2p_part=False)[0]
    t2 = pipeline_time_s(comp, p2p, n2, with_p2p_part=False)[0]
    b = (t2 - t1) / (n2 - n1)
    return t1 - b * n1, b


def usd_per_hour(slots: Sequence[Slot], sk: Sketch, layouts: Sequence[Layout]) -> float:
    """The GPUs' price: D x each stage's per-pipeline price, or, for slots that pool markets,
    the GPUs placed in each zone priced cheapest market first (`Slot.usd_per_hour`)."""
    total = 0.0
    used: dict[int, dict[str, int]] = {}
    for (si, tp), lay in zip(sk.kinds, layouts, strict=True):
        if not slots[si].offers:
            total += sk.dp * tp * slots[si].usd_per_gpu_hour
            continue
        per_zone = used.setdefault(si, {})
        for zone, k in lay:
            per_zone[zone] = per_zone.get(zone, 0) + k * tp
    return total + sum(slots[si].usd_per_hour(per_zone) for si, per_zone in used.items())


def useful_fraction(pb: Problem, sk: Sketch, layouts: Sequence[Layout], iteration_s: float) -> float:
    """The share of wall time that trains given the spot VMs this placement rents (risk.py)."""
    risk = pb.risk
    if risk is None or risk.riskless:
        return 1.0
    gpus: dict[tuple[int, str], int] = {}
    for (si, tp), lay in zip(sk.kinds, layouts, strict=True):
        for zone, k in lay:
            gpus[(si, zone)] = gpus.get((si, zone), 0) + k * tp
    slots = pb.slots
    lam = sum(-(-n // slots[si].gpus_per_node) * risk.rate(zone, slots[si].gpu_type, slots[si].market)
              for (si, zone), n in gpus.items())
    return useful_fraction_of(lam, iteration_s, risk)


def fwd_bwd(v: float | tuple[float, float]) -> tuple[float, float]:
    """A boundary's (forward, back) send seconds from `Costs.p2p_s` (one number: both ways)."""
    return (v, v) if isinstance(v, (int, float)) else v


class Placements:
    """Each placement once (`of`): zones depend on the kinds, D and the fill, not on the split or the
    microbatch size; None where it does not fit the zones or needs a link with no network profile
    (`needs_missing_link`). A search over part of the pool (slots emptied, the others as they are) shares
    the memo of the whole (`shared`): a sketch on the slots it keeps is placed the same in both, one on an
    emptied slot nowhere."""

    def __init__(self, problem: Problem, costs: Costs, *, shared: Placements | None = None) -> None:
        self.problem, self.costs = problem, costs
        self.empty = frozenset(s.index for s in problem.slots if not s.capacity)
        self.memo: dict[tuple[object, ...], tuple[Layout, ...] | None] = shared.memo if shared is not None else {}

    def key(self, kinds: tuple[tuple[int, int], ...], d: int, zone_rot: tuple[int, ...] = (),
            placement: int = STAGE_MAJOR) -> tuple[object, ...] | None:
        """The memo's key of a placement; None when it uses an emptied slot (no placement)."""
        if self.empty and any(si in self.empty for si, _ in kinds):
            return None
        return (kinds, d, zone_rot, placement)

    def known_unplaceable(self, kinds: tuple[tuple[int, int], ...], d: int) -> bool:
        """Whether D pipelines of these kinds (default fill) cannot be placed, as far as is already known."""
        key = self.key(kinds, d)
        return key is None or (key in self.memo and self.memo[key] is None)

    def of(self, sk: Sketch) -> tuple[Layout, ...] | None:
        """The sketch's layouts (`placement.place`), None where they do not fit its slots' zones or need a
        link the book has no network profile for; memoised."""
        key = self.key(sk.kinds, sk.dp, sk.zone_rot, sk.placement)
        if key is None:
            return None
        if key not in self.memo:
            lay = place(self.problem.slots, sk)
            self.memo[key] = None if lay is not None and needs_missing_link(self.problem.slots, self.costs, sk,
                                                                            lay) else lay
        return self.memo[key]
