"""The search kernel: which GPUs, how many, and how to split the model, scored by one cost model.

Contract: `Search(problem, costs).run()` is a pure, deterministic function of its inputs (the
`Costs` protocol: the simulator's building blocks in production, synthetic costs in tests). It
returns estimated candidates (`Candidate`), best first for the objective, plus every estimated
point for the frontier. It never builds a `ParallelPlan`; `core.plan` materialises and verifies
the winners with the full simulator.

The plan space (a sketch): microbatch size b, P stages with a contiguous layer partition, D
data-parallel pipelines, and per stage one replica shape k_s = (slot, tp) shared by its D
replicas (zones of a region pooled in a slot; the replicas fill the slot's zones in order).

The search, per (b, P, partition):
1. a stage table: for every stage and slot the tensor-parallel degrees that are profiled, fit in
   memory with the 1F1B in-flight microbatches, and the per-microbatch time of each;
2. a sweep over the bottleneck time tau (ascending, over the table's times): each stage takes, in
   each slot, the smallest TP whose time is <= tau (the paper's "smallest TP that fits, larger
   only if it pays": a larger TP appears only once tau needs it);
3. a dynamic program over stages whose state is the GPUs used per slot (per pipeline) and whose
   value is the cheapest assignment reaching it; the end states give, for every D, the cheapest
   assignment that D copies fit in the pool;
4. D runs over the smallest degree of each distinct microbatch count ceil(n/D) (a larger D with
   the same count only adds GPUs and ring length: paper heuristic);
5. each (assignment, D) is estimated with the simulator's own composition (1F1B pipeline time,
   gradient rings per stage, optimizer, prices, egress) and kept if it beats the bound.
Lower bounds (time: the exact 1F1B schedule's bound, `simulator.schedule.lower_bound_1f1b`, with
the best stage times, some stage at tau and the cheapest messages; cost: that time x the cheapest
GPUs) prune whole configurations and stop the tau sweep. After the sweep, the best
sketches are re-partitioned: the layers are re-balanced for the chosen GPUs (min-max stage time,
memory-checked), which the published planner never does (it splits uniformly).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations

from sailor_core.planner.costs import Costs, Layout, Slot, nic_share, zone_pairs
from sailor_core.planner.request import Constraints, Objective
from sailor_core.planner.risk import SpotRisk, useful_fraction_of
from sailor_core.simulator import StageCompute, dp_sync_end_s, pipeline_time_s
from sailor_core.simulator.schedule import lower_bound_1f1b

SECONDS_PER_HOUR = 3600.0
BYTES_PER_GB = 1e9
# A DP state's value: (primary, secondary, the usage it came from, the (slot, tp) step taken)
_Val = tuple[float, float, tuple[int, ...] | None, tuple[int, int] | None]


@dataclass(frozen=True, kw_only=True)
class Problem:
    num_layers: int
    global_batch_size: int
    tokens_per_sample: int
    slots: tuple[Slot, ...]
    mbs_values: tuple[int, ...]
    tp_values: tuple[int, ...]
    objective: Objective = Objective.MAX_THROUGHPUT
    constraints: Constraints = field(default_factory=Constraints)
    max_gpus: int | None = None
    max_stages: int = 26
    min_stages: int = 1
    exhaustive_partitions_up_to: int = 64
    keep: int = 24  # best candidates returned
    patience: int = 4  # stop adding stages after this many stage counts without a near-best plan (0: never)
    patience_slack: float = 0.05  # "near-best": within 5% of the best score so far
    tp_options: int = 2  # per stage and slot, the DP tries the smallest TPs that meet tau, this many
    tau_step: float = 0.01  # bottleneck thresholds closer than this (relative) are swept as one
    # Lexicographic objectives: scores within this (relative) of the best are equally good, and the
    # other goal decides among them (cost under max throughput, speed under the cost objectives).
    tolerance: float = 0.005
    risk: SpotRisk | None = None  # spot preemptions: scores max-goodput, and every estimate's useful fraction


@dataclass(frozen=True, order=True)
class Sketch:
    """A plan before zones and nodes: b, stage bounds, per-stage (slot index, tp), D."""

    mbs: int
    bounds: tuple[tuple[int, int], ...]
    kinds: tuple[tuple[int, int], ...]
    dp: int
    zone_rot: tuple[int, ...] = ()  # per slot: which of its zones is filled first (default: the largest)
    # STAGE_MAJOR: each stage fills its slot's zones in order on its own (a pipeline may cross zones);
    # PIPELINE_MAJOR: zone by zone, as many whole pipelines as fit first (no cross-zone sends), the
    # rest stage-major.
    placement: int = 0

    @property
    def num_stages(self) -> int:
        return len(self.bounds)


STAGE_MAJOR = 0
PIPELINE_MAJOR = 1


@dataclass(frozen=True, kw_only=True)
class Estimate:
    iteration_s: float
    usd_per_iteration: float
    usd_per_hour: float
    num_gpus: int
    layouts: tuple[Layout, ...]
    useful_fraction: float = 1.0  # expected share of wall time that trains, given spot preemptions (risk.py)

    @property
    def iterations_per_s(self) -> float:
        return 1.0 / self.iteration_s


@dataclass(frozen=True, kw_only=True)
class Candidate:
    sketch: Sketch
    estimate: Estimate
    score: float  # lower is better for the request's objective


@dataclass(frozen=True)
class _Floor:
    """Lower-bound terms of one (mbs, partition), stage by stage, for `schedule.lower_bound_1f1b`:
    stage b is reached no earlier than `reach[b]` (the cheapest stages and sends before it, both
    ways), computes m microbatches of at least `best[b]` and waits at least (m - 1) `act[b]` and
    m `grad[b]` for its neighbours; `opt` is the least optimizer step that ends the iteration."""

    reach: tuple[float, ...]
    best: tuple[float, ...]
    act: tuple[float, ...]  # the cheapest activation into stage b (0 for the first)
    grad: tuple[float, ...]  # the cheapest gradient into stage b (0 for the last)
    opt: float
    rate: float  # USD/hour of the cheapest GPUs per pipeline
    memo: dict[int, tuple[float, float]] = field(default_factory=dict, compare=False, repr=False)

    def at(self, m: int) -> tuple[float, float]:
        """(the least wait of any stage, the largest bound of a stage at its cheapest time) at m
        microbatches: the parts of the bound that do not depend on tau."""
        v = self.memo.get(m)
        if v is None:
            waits = [(m - 1) * a + m * g + r for a, g, r in zip(self.act, self.grad, self.reach, strict=True)]
            v = (min(waits), max(m * t + w for t, w in zip(self.best, waits, strict=True)))
            self.memo[m] = v
        return v


@dataclass
class Counters:
    configurations: int = 0
    assignments: int = 0
    candidates: int = 0
    pruned: int = 0


class Search:
    def __init__(self, problem: Problem, costs: Costs) -> None:
        self.pb = problem
        self.costs = costs
        self.n_slots = len(problem.slots)
        self.caps = tuple(s.capacity for s in problem.slots)
        self.total_gpus = min(sum(self.caps), problem.max_gpus or sum(self.caps))
        self.count = Counters()
        self._best: list[tuple[float, int, Candidate]] = []  # max-heap on score via negation
        self._seen: set[Sketch] = set()
        self._placed: set[tuple[object, ...]] = set()
        self._tie = 0
        self.points: list[tuple[float, float, Sketch]] = []  # (iterations/s, USD/iteration, sketch)
        self.incumbent = math.inf
        self.nearest: tuple[float, str] | None = None  # smallest violation seen, and its reason
        self._p2p_floor: dict[tuple[int, int], float] = {}
        # quick_bound's terms that do not depend on D, per (mbs, bounds, kinds)
        self._sketch_terms: dict[tuple[object, ...], tuple[tuple[float, ...], float, float, float]] = {}
        self._p2p_fill_floor: dict[tuple[int, int], float] = {}
        self._p2p_dir_floor: dict[tuple[int, int], tuple[float, float]] = {}
        self._round_best = math.inf
        self._violators: list[tuple[float, int, Candidate]] = []  # best scores that break a limit
        self._closest: list[tuple[float, int, Candidate]] = []  # smallest breaches of a limit
        self._near: list[tuple[float, float, int, Candidate]] = []  # (secondary, score, tie, c) within tolerance

    # -- objective -------------------------------------------------------------------------
    def score(self, e: Estimate) -> float:
        o = self.pb.objective
        if o is Objective.MAX_THROUGHPUT:
            return e.iteration_s
        if o is Objective.MIN_COST:
            return e.usd_per_iteration
        if o is Objective.MAX_GOODPUT:
            return e.usd_per_iteration / e.useful_fraction if e.useful_fraction > 0 else math.inf
        return e.usd_per_iteration / (self.pb.global_batch_size * self.pb.tokens_per_sample) * 1e6

    def secondary(self, e: Estimate) -> float:
        """The other goal, deciding among plans whose scores are within the tolerance: cost under max
        throughput, time under the cost objectives (expected time per useful iteration under goodput)."""
        if self.pb.objective is Objective.MAX_THROUGHPUT:
            return e.usd_per_iteration
        if self.pb.objective is Objective.MAX_GOODPUT:
            return e.iteration_s / e.useful_fraction if e.useful_fraction > 0 else math.inf
        return e.iteration_s

    @property
    def cutoff(self) -> float:
        """Scores at or above this cannot be chosen: worse than the incumbent by more than the tolerance."""
        return self.incumbent * (1 + self.pb.tolerance)

    def violation(self, e: Estimate) -> float:
        """How far past the constraints (relative; 0 when within)."""
        c = self.pb.constraints
        v = 0.0
        if c.max_usd_per_iteration is not None:
            v = max(v, e.usd_per_iteration / c.max_usd_per_iteration - 1)
        if c.max_usd_per_hour is not None:
            v = max(v, e.usd_per_hour / c.max_usd_per_hour - 1)
        if c.min_iterations_per_s is not None:
            v = max(v, c.min_iterations_per_s / e.iterations_per_s - 1)
        return v

    # -- estimate (the simulator's composition, stage by stage) --------------------------------
    def layouts(self, sk: Sketch) -> tuple[Layout, ...] | None:
        """Place each stage's D replicas in its slot's zones (see `Sketch.placement`), pipeline order."""
        free = {i: [n for _, n in s.zones] for i, s in enumerate(self.pb.slots)}
        lays: list[list[tuple[str, int]]] = [[] for _ in sk.kinds]
        need = sk.dp
        if sk.placement == PIPELINE_MAJOR:
            need -= self._whole_pipelines(sk, free, lays)
        for s, (slot_i, tp) in enumerate(sk.kinds):
            slot = self.pb.slots[slot_i]
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

    def _whole_pipelines(self, sk: Sketch, free: dict[int, list[int]], lays: list[list[tuple[str, int]]]) -> int:
        """Zone by zone (stage 0's slot's fill order first), as many whole pipelines as fit there."""
        slots = self.pb.slots
        g0 = sk.kinds[0][0]
        nz = len(slots[g0].zones)
        rot = sk.zone_rot[g0] if sk.zone_rot else 0
        order = [slots[g0].zones[(rot + i) % nz][0] for i in range(nz)]
        for g, _ in sk.kinds:
            order += [z for z, _ in slots[g].zones if z not in order]
        index = [{z: i for i, (z, _) in enumerate(slots[g].zones)} for g, _ in sk.kinds]
        placed = 0
        for zone in order:
            if placed == sk.dp:
                break
            if any(zone not in ix for ix in index):
                continue

            def room(k: int, zone: str = zone) -> dict[tuple[int, int], int] | None:
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

    def estimate(self, sk: Sketch, layouts: tuple[Layout, ...] | None = None) -> Estimate | None:
        layouts = layouts or self.layouts(sk)
        if layouts is None:
            return None
        c = self.costs
        slots = self.pb.slots
        n = self.pb.global_batch_size // sk.mbs
        m = -(-n // sk.dp)
        p = sk.num_stages
        comp: list[StageCompute] = []
        for (first, last), (si, tp) in zip(sk.bounds, sk.kinds, strict=True):
            comp.append(c.compute(slots[si].gpu_type, sk.mbs, tp, first, last))
        p2p: list[tuple[float, float]] = []
        egress = 0.0
        for s in range(p - 1):
            (sa, ta), (sb, tb) = sk.kinds[s], sk.kinds[s + 1]
            a, b = slots[sa], slots[sb]
            msg = c.boundary_bytes(ta, sk.bounds[s][1], sk.mbs)
            worst_f = worst_b = 0.0
            for za, zb, cnt in zone_pairs(layouts[s], layouts[s + 1]):
                share = nic_share(a, ta, layouts[s], za, b, tb, layouts[s + 1], zb)
                f, bk = _fwd_bwd(c.p2p_s(a, ta, za, b, tb, zb, msg, share))
                worst_f, worst_b = max(worst_f, f), max(worst_b, bk)
                if za != zb:
                    # each of these cnt pipelines sends about n/D microbatches each way, one message
                    # per microbatch in slices (SimModel.boundary_p2p_s)
                    gb = msg * (n / sk.dp) * cnt / BYTES_PER_GB
                    egress += gb * (c.egress_usd_per_gb(za, zb) + c.egress_usd_per_gb(zb, za))
            p2p.append((worst_f, worst_b))
        total, _, finish = pipeline_time_s(comp, p2p, m, with_p2p_part=False)
        ends: list[float] = []
        opt = 0.0
        for s, ((first, last), (si, tp)) in enumerate(zip(sk.bounds, sk.kinds, strict=True)):
            slot = slots[si]
            if sk.dp > 1:  # the simulator's bucket overlap with the last backward (dp_sync_end_s)
                ar, ar_last, first_bwd = c.dp_sync_terms(slot, tp, layouts[s], sk.mbs, first, last)
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
        if p > 1:  # the tied embedding/head exchange after the first and last stages' rings (simulator._tied_sync)
            (sa, ta), (sb, tb) = sk.kinds[0], sk.kinds[-1]
            tied = 0.0
            for za, zb, cnt in zone_pairs(layouts[0], layouts[-1]):
                t, gb = c.tied_sync(slots[sa], ta, za, slots[sb], tb, zb)
                tied = max(tied, t)
                if za != zb:
                    egress += gb * cnt * (c.egress_usd_per_gb(za, zb) + c.egress_usd_per_gb(zb, za))
            end = max(end, max(ends[0], ends[-1]) + tied)
        iteration = total + max(0.0, end - total) + opt
        gpus = sum(tp for _, tp in sk.kinds) * sk.dp
        usd_per_s = self.usd_per_hour(sk, layouts) / SECONDS_PER_HOUR
        usd_iter = usd_per_s * iteration + egress
        return Estimate(
            iteration_s=iteration,
            usd_per_iteration=usd_iter,
            usd_per_hour=usd_iter / iteration * SECONDS_PER_HOUR,
            num_gpus=gpus,
            layouts=layouts,
            useful_fraction=self.useful_fraction(sk, layouts, iteration),
        )

    def usd_per_hour(self, sk: Sketch, layouts: Sequence[Layout]) -> float:
        """The GPUs' price: D x each stage's per-pipeline price, or, for slots that pool markets,
        the GPUs placed in each zone priced cheapest market first (`Slot.usd_per_hour`)."""
        slots = self.pb.slots
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

    def useful_fraction(self, sk: Sketch, layouts: Sequence[Layout], iteration_s: float) -> float:
        """The share of wall time that trains given the spot VMs this placement rents (risk.py)."""
        risk = self.pb.risk
        if risk is None or risk.riskless:
            return 1.0
        gpus: dict[tuple[int, str], int] = {}
        for (si, tp), lay in zip(sk.kinds, layouts, strict=True):
            for zone, k in lay:
                gpus[(si, zone)] = gpus.get((si, zone), 0) + k * tp
        slots = self.pb.slots
        lam = sum(-(-n // slots[si].gpus_per_node) * risk.rate(zone, slots[si].gpu_type, slots[si].market)
                  for (si, zone), n in gpus.items())
        return useful_fraction_of(lam, iteration_s, risk)

    def consider(self, sk: Sketch) -> Candidate | None:
        if sk in self._seen:
            return None
        self._seen.add(sk)
        if self.pb.max_gpus is not None and sk.dp * sum(tp for _, tp in sk.kinds) > self.pb.max_gpus:
            return None
        layouts = self.layouts(sk)
        if layouts is None:
            return None
        # Placements that put every replica in the same zones are one plan (a zone rotation or a
        # pipeline-major fill changes nothing on one zone): estimate it once.
        placed = (sk.mbs, sk.bounds, sk.kinds, sk.dp, layouts)
        if placed in self._placed:
            return None
        self._placed.add(placed)
        e = self.estimate(sk, layouts)
        self.count.candidates += 1
        if e is None or not math.isfinite(e.iteration_s):
            return None  # no zone room, or a link without a network profile
        self.points.append((e.iterations_per_s, e.usd_per_iteration, sk))
        cand = Candidate(sketch=sk, estimate=e, score=self.score(e))
        v = self.violation(e)
        if v <= 0:
            self._round_best = min(self._round_best, cand.score)
        if v > 0:
            if self.nearest is None or v < self.nearest[0]:
                self.nearest = (v, _describe_violation(self.pb.constraints, e))
            # Fast (or cheap) plans that break a limit seed the local pass: one changed stage
            # (a zone, a cheaper GPU) may bring them within it.
            self._tie += 1
            heapq.heappush(self._violators, (-cand.score, -self._tie, cand))
            if len(self._violators) > 16:
                heapq.heappop(self._violators)
            heapq.heappush(self._closest, (-v, -self._tie, cand))
            if len(self._closest) > 16:
                heapq.heappop(self._closest)
            # Kept only if close: the simulator has the final word on constraints.
            if v > 0.02:
                return cand
        self._tie += 1
        # heap of the best `keep` (largest score on top) by (feasible-first, score)
        key = (1.0 if v > 0 else 0.0) * 1e18 + cand.score
        heapq.heappush(self._best, (-key, -self._tie, cand))
        if len(self._best) > self.pb.keep:
            heapq.heappop(self._best)
        if v <= 0:
            self.incumbent = min(self.incumbent, cand.score)
            self._keep_near(cand)
        return cand

    def _keep_near(self, cand: Candidate) -> None:
        """Keep the best candidates by the other goal among those within the tolerance of the incumbent."""
        if cand.score > self.cutoff:
            return
        self._near.append((self.secondary(cand.estimate), cand.score, self._tie, cand))
        if len(self._near) > 2 * self.pb.keep:
            cut = self.cutoff
            self._near = sorted(x for x in self._near if x[1] <= cut)[: self.pb.keep]

    # -- the sweep ---------------------------------------------------------------------------
    def run(self) -> list[Candidate]:
        pb = self.pb
        max_p = min(pb.max_stages, pb.num_layers)
        for mbs in sorted(pb.mbs_values, reverse=True):
            if pb.global_batch_size % mbs:
                continue
            misses = 0
            for p in range(pb.min_stages, max_p + 1):
                self._round_best = math.inf
                for bounds in self.partitions(p, mbs):
                    self.count.configurations += 1
                    self.sweep(mbs, bounds)
                # Patience: deeper pipelines only add bubbles and sends once memory and GPU types
                # are served; stop after `patience` stage counts in a row that come nowhere near.
                if self._round_best > self.incumbent * (1 + pb.patience_slack):
                    misses += 1
                    if pb.patience and misses >= pb.patience:
                        break
                else:
                    misses = 0
        self.rebalance_pass()
        self.local_pass()
        return self.best()

    def best(self) -> list[Candidate]:
        """Best first: within the tolerance of the best score by the other goal, then by score."""
        cut = self.cutoff
        near = [c for _, score, _, c in sorted(self._near) if score <= cut]
        items = sorted(self._best, key=lambda t: (-t[0], -t[1]))
        return list({c.sketch: c for c in near + [c for _, _, c in items]}.values())

    def d_values(self, n: int, d_max: int) -> list[int]:
        """The smallest D for each distinct microbatch count ceil(n/D), D <= d_max."""
        out = []
        last_m = None
        for d in range(1, min(n, d_max) + 1):
            m = -(-n // d)
            if m != last_m:
                out.append(d)
                last_m = m
        return out

    def stage_table(self, mbs: int, bounds: Sequence[tuple[int, int]]) -> list[list[list[tuple[int, float]]]] | None:
        """table[s][slot] = [(tp, seconds per microbatch)] for TPs that are profiled and fit, TP ascending."""
        p = len(bounds)
        table = []
        for s, (first, last) in enumerate(bounds):
            row = []
            any_ok = False
            for slot in self.pb.slots:
                opts = []
                for tp in self.pb.tp_values:
                    if tp > slot.gpus_per_node or not self.costs.profiled(slot.gpu_type, mbs, tp):
                        continue
                    if not self.costs.fits(slot.gpu_type, tp, first, last, mbs=mbs, in_flight=p - s,
                                           first_stage=s == 0, last_stage=s == p - 1):
                        continue
                    opts.append((tp, self.costs.compute(slot.gpu_type, mbs, tp, first, last).total_s))
                any_ok |= bool(opts)
                row.append(opts)
            if not any_ok:
                return None
            table.append(row)
        return table

    def sweep(self, mbs: int, bounds: tuple[tuple[int, int], ...]) -> None:
        pb = self.pb
        table = self.stage_table(mbs, bounds)
        if table is None:
            return
        p = len(bounds)
        n = pb.global_batch_size // mbs
        slots = pb.slots
        best_t = [min(t for row in table[s] for _, t in row) for s in range(p)]
        min_gpus = [min(tp for row in table[s] for tp, _ in row) for s in range(p)]
        min_rate = [
            min(tp * slots[g].usd_per_gpu_hour for g, row in enumerate(table[s]) for tp, _ in row) for s in range(p)
        ]
        # Network and optimizer floors: every boundary sends at least its cheapest message each way
        # (the exact schedule's bound, simulator.schedule.lower_bound_1f1b, with the cheapest stage
        # times and messages), and some stage's optimizer step ends the iteration.
        dirs = [self.p2p_dir_floor(mbs, bounds[b][1]) for b in range(p - 1)]
        reach = [0.0]
        for b in range(p - 1):
            reach.append(reach[-1] + best_t[b] + self.p2p_fill_floor(mbs, bounds[b][1]))
        opt_lb = max(
            min(self.costs.optimizer_s(slots[g].gpu_type, mbs, tp, *bounds[s]) for g, row in enumerate(table[s])
                for tp, _ in row)
            for s in range(p)
        )
        lb = _Floor(
            reach=tuple(reach),
            best=tuple(best_t),
            act=tuple([0.0] + [f for f, _ in dirs]),
            grad=tuple([bk for _, bk in dirs] + [0.0]),
            opt=opt_lb,
            rate=sum(min_rate),
        )
        d_cap = max(1, self.total_gpus // max(1, sum(min_gpus)))
        d_list = self.d_values(n, d_cap)
        if not d_list:
            return
        taus = sorted({t for s in range(p) for row in table[s] for _, t in row if t >= max(best_t)})
        # Merging thresholds only pays (and only risks) when there are many of them.
        step = self.pb.tau_step if len(taus) > 48 else 0.0
        for k, tau in enumerate(taus):
            if self.bound(tau, lb, n, d_list) >= self.cutoff:
                self.count.pruned += 1
                break
            # Thresholds within tau_step of the next one are covered by it (its options include
            # theirs but for a TP the next one no longer needs): at most that much on the bottleneck.
            if step and k + 1 < len(taus) and taus[k + 1] <= tau * (1 + step):
                continue
            self.assign(mbs, bounds, table, tau, n, d_list, lb)

    def p2p_floor(self, mbs: int, last: int) -> float:
        """The cheapest one-way message after layer `last` over any pair of GPU kinds in one zone."""
        key = (mbs, last)
        v = self._p2p_floor.get(key)
        if v is None:
            c = self.costs
            v = both = lo_f = lo_b = math.inf
            for a in self.pb.slots:
                for ta in self.pb.tp_values:
                    if ta > a.gpus_per_node or not c.profiled(a.gpu_type, mbs, ta):
                        continue
                    msg = c.boundary_bytes(ta, last, mbs)
                    for b in self.pb.slots:
                        for tb in self.pb.tp_values:
                            if tb > b.gpus_per_node or not c.profiled(b.gpu_type, mbs, tb):
                                continue
                            for za, _ in a.zones:
                                for zb, _ in b.zones:
                                    f, bk = _fwd_bwd(c.p2p_s(a, ta, za, b, tb, zb, msg))
                                    v = min(v, max(f, bk))
                                    both = min(both, f + bk)
                                    lo_f, lo_b = min(lo_f, f), min(lo_b, bk)
            v = 0.0 if not math.isfinite(v) else v
            self._p2p_floor[key] = v
            self._p2p_fill_floor[key] = 0.0 if not math.isfinite(both) else both
            self._p2p_dir_floor[key] = (lo_f if math.isfinite(lo_f) else 0.0, lo_b if math.isfinite(lo_b) else 0.0)
        return v

    def p2p_dir_floor(self, mbs: int, last: int) -> tuple[float, float]:
        """The least activation and the least gradient time of that boundary, each on its own."""
        self.p2p_floor(mbs, last)
        return self._p2p_dir_floor[(mbs, last)]

    def p2p_fill_floor(self, mbs: int, last: int) -> float:
        """The least forward + back send time of that boundary (what the first microbatch pays)."""
        self.p2p_floor(mbs, last)
        return self._p2p_fill_floor[(mbs, last)]

    def bound(self, tau: float, lb: _Floor, n: int, d_list: Sequence[int]) -> float:
        """A lower bound on the score of anything with compute bottleneck >= tau."""
        o = self.pb.objective
        c = self.pb.constraints
        best = math.inf
        for d in d_list:
            m = -(-n // d)
            # some stage computes at least tau per microbatch (which one is not known: the least of
            # them), and every stage at least its cheapest time
            least_wait, floor = lb.at(m)
            t = lb.opt + max(m * tau + least_wait, floor)
            if c.min_iterations_per_s is not None and 1.0 / t < c.min_iterations_per_s * 0.98:
                continue  # too slow at this D whatever it runs on
            if o is Objective.MAX_THROUGHPUT:
                best = min(best, t)
            else:
                usd = t * d * lb.rate / SECONDS_PER_HOUR
                if o is Objective.MIN_COST_PER_TOKEN:
                    usd = usd / (self.pb.global_batch_size * self.pb.tokens_per_sample) * 1e6
                best = min(best, usd)
        return best

    def assign(
        self,
        mbs: int,
        bounds: tuple[tuple[int, int], ...],
        table: list[list[list[tuple[int, float]]]],
        tau: float,
        n: int,
        d_list: Sequence[int],
        lb: _Floor,
    ) -> None:
        """DP over stages at bottleneck tau: cheapest per-pipeline GPU usage per slot-usage vector."""
        self.count.assignments += 1
        options = self._stage_options(table, tau)
        if options is None:
            return
        dp = self._usage_dp(options)
        if dp is None:
            return
        layers, states = dp
        for d, front in self._fronts(self._end_states(states), tau, n, d_list, lb):
            for pick in dict.fromkeys(front):
                kinds = self._reconstruct(layers, pick)
                if self.quick_bound(mbs, bounds, kinds, d, n) >= self.cutoff:
                    self.count.pruned += 1
                    continue
                self.consider(Sketch(mbs=mbs, bounds=bounds, kinds=kinds, dp=d))

    def _stage_options(
        self, table: list[list[list[tuple[int, float]]]], tau: float,
    ) -> list[list[tuple[int, int, float, float]]] | None:
        """options[s] = [(slot, tp, primary, secondary)] of the TPs that meet tau; None when a stage has none.

        Each stage, each slot: the smallest TP that meets tau. The DP keeps, per usage vector, the
        lexicographically best (primary, secondary) value: for throughput the summed stage times
        (the pipeline fill) then the price; for cost objectives the price then the times."""
        slots = self.pb.slots
        thr = self.pb.objective is Objective.MAX_THROUGHPUT
        options = []
        for row in table:
            opts = []
            for g, cand in enumerate(row):
                # The smallest TP that meets tau, and the next larger one: tau sees compute only,
                # a larger TP can still pay through shorter sends per cycle or a shorter fill.
                fit = [(tp, t) for tp, t in cand if t <= tau][: self.pb.tp_options]
                for tp, t in fit:
                    price = tp * slots[g].usd_per_gpu_hour
                    opts.append((g, tp, t if thr else price, price if thr else t))
            if not opts:
                return None
            options.append(opts)
        return options

    def _usage_dp(
        self, options: list[list[tuple[int, int, float, float]]],
    ) -> tuple[list[dict[tuple[int, ...], _Val]], dict[tuple[int, ...], _Val]] | None:
        """(every stage's layer of the DP, its last layer): per per-pipeline slot usage that fits the
        slots' capacity, the best (primary, secondary) and the step that reached it; None if none fits."""
        zero = (0,) * self.n_slots
        layers: list[dict[tuple[int, ...], _Val]] = []
        states: dict[tuple[int, ...], _Val] = {zero: (0.0, 0.0, None, None)}
        caps = self.caps
        for opts in options:
            nxt: dict[tuple[int, ...], _Val] = {}
            for u, (p1, p2, _, _) in states.items():
                for g, tp, x1, x2 in opts:
                    if u[g] + tp > caps[g]:
                        continue
                    v = u[:g] + (u[g] + tp,) + u[g + 1 :]
                    q1 = p1 + x1
                    q2 = p2 + x2
                    old = nxt.get(v)
                    if old is None or q1 < old[0] - 1e-12 or (q1 <= old[0] + 1e-12 and q2 < old[1] - 1e-12):
                        nxt[v] = (q1, q2, u, (g, tp))
            if not nxt:
                return None
            layers.append(nxt)
            states = nxt
        return layers, states

    def _end_states(self, states: dict[tuple[int, ...], _Val]) -> list[tuple[int, float, float, tuple[int, ...]]]:
        """(D-capacity, primary, secondary, usage) of each end state, most copies first then best value."""
        caps = self.caps
        k = self.n_slots
        ends = []
        for u, (p1, p2, _, _) in states.items():
            d_max = min((caps[g] // u[g] for g in range(k) if u[g]), default=0)
            if self.pb.max_gpus is not None:
                d_max = min(d_max, self.pb.max_gpus // max(1, sum(u)))
            ends.append((d_max, p1, p2, u))
        ends.sort(key=lambda e: (-e[0], e[1], e[2], e[3]))
        return ends

    def _fronts(
        self, ends: list[tuple[int, float, float, tuple[int, ...]]], tau: float, n: int, d_list: Sequence[int],
        lb: _Floor,
    ) -> Iterator[tuple[int, list[tuple[int, ...]]]]:
        """Yields (D, the usage vectors worth estimating at D), largest D first, each D only while the
        bound (read at that moment: estimates of earlier D move the cutoff) does not rule it out."""
        thr = self.pb.objective is Objective.MAX_THROUGHPUT
        # With a limit that couples time and money (a budget under max throughput, a minimum speed
        # under min cost) the answer may sit between the two keys' optima: take the Pareto set.
        cons = self.pb.constraints
        coupled = (thr and (cons.max_usd_per_iteration is not None or cons.max_usd_per_hour is not None)) or (
            not thr and cons.min_iterations_per_s is not None
        )
        risk = self.pb.risk
        risky = self.pb.objective is Objective.MAX_GOODPUT and risk is not None and not risk.riskless
        eligible: list[tuple[float, float, tuple[int, ...]]] = []
        i = 0
        for d in reversed(d_list):
            while i < len(ends) and ends[i][0] >= d:
                bisect.insort(eligible, (ends[i][1], ends[i][2], ends[i][3]))
                i += 1
            if not eligible:
                continue
            if self.bound(tau, lb, n, [d]) >= self.cutoff:
                continue
            front = _pareto_front(eligible, coupled)
            if risky:
                # Price and time alone always prefer spot; at this D the risk of each state's spot VMs
                # decides: add the states best by an estimate of the goodput score.
                m = -(-n // d)
                ranked = sorted(eligible, key=lambda e: (self._approx_goodput(e[0], e[1], e[2], d, m, tau), e))
                front += [u for _, _, u in ranked[:2]]
            yield d, front

    def _approx_goodput(self, usd_per_hour: float, fill_s: float, use: tuple[int, ...], d: int, m: int,
                        tau: float) -> float:
        """Goodput score of a DP end state at D, before placement: time fill + (m - 1) tau, each
        slot's VMs at the rate of its first zone."""
        risk = self.pb.risk
        assert risk is not None
        t = fill_s + (m - 1) * tau
        slots = self.pb.slots
        lam = sum(-(-d * g_use // slots[g].gpus_per_node) * risk.rate(slots[g].zones[0][0], slots[g].gpu_type,
                                                                    slots[g].market)
                  for g, g_use in enumerate(use) if g_use)
        return d * usd_per_hour * t / SECONDS_PER_HOUR / useful_fraction_of(lam, t, risk)

    def quick_bound(self, mbs: int, bounds: tuple[tuple[int, int], ...], kinds: tuple[tuple[int, int], ...], d: int,
                    n: int) -> float:
        """Score lower bound of a sketch without network terms (they only add time and egress)."""
        slots = self.pb.slots
        c = self.costs
        fixed = self._sketch_terms.get((mbs, bounds, kinds))
        if fixed is None:
            ts = [c.compute(slots[si].gpu_type, mbs, tp, a, b).total_s
                  for (a, b), (si, tp) in zip(bounds, kinds, strict=True)]
            (a0, b0), (s0, tp0) = bounds[0], kinds[0]
            fixed = (tuple(ts), c.compute(slots[s0].gpu_type, mbs, tp0, a0, b0).backward_s,
                     max(c.optimizer_s(slots[si].gpu_type, mbs, tp, a, b)
                         for (a, b), (si, tp) in zip(bounds, kinds, strict=True)),
                     float(sum(tp * slots[si].usd_per_gpu_hour for si, tp in kinds)))
            if len(self._sketch_terms) > 200_000:
                self._sketch_terms.clear()
            self._sketch_terms[(mbs, bounds, kinds)] = fixed
        times, bwd0, opt_s, usd_per_hour = fixed
        m = -(-n // d)
        # simulator.schedule.lower_bound_1f1b without the sends: stage b starts after the stages
        # before it have run microbatch 0 both ways and computes m microbatches
        half = [x / 2 for x in times]
        t = opt_s + lower_bound_1f1b(half, half, [0.0] * (len(times) - 1), [0.0] * (len(times) - 1), m)
        # The gradient ring only adds time: skip it when the sketch loses without it.
        score = self._score_of(t, d, usd_per_hour)
        if d > 1 and score < self.cutoff:
            # Stage 0's gradient ring starts no earlier than its last backward (the buckets overlap
            # that backward at most) and the optimizer step follows: both bound the iteration from
            # below. Its ring on one zone is the fastest it can be (a cross-zone ring is slower).
            (a0, b0), (s0, tp0) = bounds[0], kinds[0]
            ar, ar_last, first_bwd = c.dp_sync_terms(slots[s0], tp0, ((slots[s0].zones[0][0], d),), mbs, a0, b0)
            # dp_sync_end_s - finish >= both of these
            score = self._score_of(t + max(ar_last, ar - bwd0 + first_bwd), d, usd_per_hour)
        return score

    def _score_of(self, t: float, d: int, usd_per_hour: float) -> float:
        """The objective's score of an iteration of t seconds on D replicas at that price per replica
        hour; infinite when a constraint rules it out."""
        cons = self.pb.constraints
        if cons.min_iterations_per_s is not None and 1.0 / t < cons.min_iterations_per_s * 0.98:
            return math.inf
        o = self.pb.objective
        if o is Objective.MAX_THROUGHPUT:
            return t
        usd = t * d * usd_per_hour / SECONDS_PER_HOUR
        if cons.max_usd_per_iteration is not None and usd > cons.max_usd_per_iteration * 1.02:
            return math.inf
        if o is Objective.MIN_COST_PER_TOKEN:
            usd = usd / (self.pb.global_batch_size * self.pb.tokens_per_sample) * 1e6
        return usd

    @staticmethod
    def _reconstruct(layers: list[dict[tuple[int, ...], _Val]], end: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        kinds: list[tuple[int, int]] = []
        u: tuple[int, ...] | None = end
        for i, layer in enumerate(reversed(layers)):
            if u is None:
                raise RuntimeError(f"usage DP: the back-pointers end {len(layers) - i} stages early")
            _, _, prev, kind = layer[u]
            if kind is None:
                raise RuntimeError(f"usage DP: state {u} of stage {len(layers) - 1 - i} has no (slot, tp) kind")
            kinds.append(kind)
            u = prev
        return tuple(reversed(kinds))

    # -- partitions --------------------------------------------------------------------------
    def partitions(self, p: int, mbs: int) -> Iterator[tuple[tuple[int, int], ...]]:
        L = self.pb.num_layers
        seen: set[tuple[tuple[int, int], ...]] = set()
        # Every split when there are few (small models, 2 stages); deep pipelines of a large model
        # have few splits too (p close to L) but nothing to gain from them beyond uniform/balanced.
        if math.comb(L - 1, p - 1) <= self.pb.exhaustive_partitions_up_to and (2 * (p - 1) <= L - 1 or L <= 12):
            for cuts in combinations(range(1, L), p - 1):
                b = _bounds_from_cuts(cuts, L)
                seen.add(b)
                yield b
            return
        uni = uniform_partition(L, p)
        seen.add(uni)
        yield uni
        for slot in self.pb.slots:
            for tp in self.pb.tp_values:
                if tp > slot.gpus_per_node or not self.costs.profiled(slot.gpu_type, mbs, tp):
                    continue
                times = [self.costs.compute(slot.gpu_type, mbs, tp, i, i).total_s for i in range(L)]
                bal = balanced_partition(times, p)
                if bal is not None and bal not in seen:
                    seen.add(bal)
                    yield bal
                break  # the smallest profiled TP of each GPU type is enough to shape the split

    def local_pass(self, top: int = 8, rounds: int = 4) -> None:
        """Network-aware polish: the DP sees compute, memory and price only, so among equally fast
        choices (the same GPU in two zones at different prices) it cannot tell which keeps pipeline
        sends and gradient rings inside a zone. Try, on the best sketches, every other GPU kind on
        one stage and every swap of two stages' kinds, scored by the full estimate."""
        pb = self.pb
        for _ in range(rounds):
            before = self._progress()
            near = [c for _, _, c in sorted(self._violators, key=lambda t: (-t[0], -t[1]))]
            near += [c for _, _, c in sorted(self._closest, key=lambda t: (-t[0], -t[1]))]
            for cand in self.best()[:top] + near:
                sk = cand.sketch
                p = sk.num_stages
                kinds_all = [
                    (g, tp) for g, slot in enumerate(pb.slots) for tp in pb.tp_values
                    if tp <= slot.gpus_per_node and self.costs.profiled(slot.gpu_type, sk.mbs, tp)
                ]
                for s in range(p):
                    first, last = sk.bounds[s]
                    for k in kinds_all:
                        if k == sk.kinds[s]:
                            continue
                        if not self.costs.fits(pb.slots[k[0]].gpu_type, k[1], first, last, mbs=sk.mbs, in_flight=p - s,
                                               first_stage=s == 0, last_stage=s == p - 1):
                            continue
                        kinds = sk.kinds[:s] + (k,) + sk.kinds[s + 1:]
                        self._neighbor(Sketch(mbs=sk.mbs, bounds=sk.bounds, kinds=kinds, dp=sk.dp,
                                              placement=sk.placement), cand)
                for s in range(p):
                    for t in range(s + 1, p):
                        if sk.kinds[s] == sk.kinds[t]:
                            continue
                        kinds_l = list(sk.kinds)
                        kinds_l[s], kinds_l[t] = kinds_l[t], kinds_l[s]
                        ok = all(
                            self.costs.fits(pb.slots[kinds_l[i][0]].gpu_type, kinds_l[i][1], *sk.bounds[i], mbs=sk.mbs,
                                            in_flight=p - i, first_stage=i == 0, last_stage=i == p - 1)
                            for i in (s, t)
                        )
                        if ok:
                            self._neighbor(Sketch(mbs=sk.mbs, bounds=sk.bounds, kinds=tuple(kinds_l), dp=sk.dp,
                                                  placement=sk.placement), cand)
            if self._progress() >= before:
                break

    def _progress(self) -> tuple[float, float]:
        """(best score, then the best other goal within the tolerance): lower is progress."""
        near = [sec for sec, score, _, _ in self._near if score <= self.cutoff]
        return self.incumbent, min(near, default=math.inf)

    def _neighbor(self, sk: Sketch, seed: Candidate) -> None:
        """Consider a neighbour; if it looks promising, also with its layers re-split for its GPUs."""
        c = self.consider(sk)
        if c is None or sk.num_stages < 2:
            return
        v = self.violation(c.estimate)
        promising = (v <= 0 and c.score <= self.incumbent * 1.1) or (0 < v < self.violation(seed.estimate))
        if promising or self.pb.num_layers <= 12:  # re-splitting a small model is cheap: always
            b = self.rebalanced(sk)
            if b is not None and b != sk.bounds:
                self.consider(Sketch(mbs=sk.mbs, bounds=b, kinds=sk.kinds, dp=sk.dp, placement=sk.placement))

    def rebalance_pass(self) -> None:
        """Re-split the layers of the best sketches for the GPUs they chose (heterogeneous min-max)."""
        for cand in self.best():
            sk = cand.sketch
            if sk.num_stages < 2:
                continue
            b = self.rebalanced(sk)
            if b is not None and b != sk.bounds:
                self.consider(Sketch(mbs=sk.mbs, bounds=b, kinds=sk.kinds, dp=sk.dp))
        # Zones of a region differ in their measured links: try starting the fill at each zone. With
        # several stages, also placed whole pipelines per zone first: the same speed where compute
        # is the bottleneck, without paying egress for every microbatch sent across zones.
        for cand in self.best():
            sk = cand.sketch
            used = sorted({si for si, _ in sk.kinds})
            placements = (STAGE_MAJOR, PIPELINE_MAJOR) if sk.num_stages > 1 else (STAGE_MAJOR,)
            for placement in placements:
                if placement == PIPELINE_MAJOR:
                    self.consider(replace(sk, zone_rot=(), placement=placement))
                for si in used:
                    for r in range(1, len(self.pb.slots[si].zones)):
                        rot = [0] * self.n_slots
                        rot[si] = r
                        self.consider(replace(sk, zone_rot=tuple(rot), placement=placement))

    def rebalanced(self, sk: Sketch) -> tuple[tuple[int, int], ...] | None:
        L = self.pb.num_layers
        p = sk.num_stages
        slots = self.pb.slots
        c = self.costs

        def stage_t(s: int, first: int, last: int) -> float:
            si, tp = sk.kinds[s]
            return c.compute(slots[si].gpu_type, sk.mbs, tp, first, last).total_s

        def fits(s: int, first: int, last: int) -> bool:
            si, tp = sk.kinds[s]
            return c.fits(slots[si].gpu_type, tp, first, last, mbs=sk.mbs, in_flight=p - s,
                          first_stage=s == 0, last_stage=s == p - 1)

        def greedy(tau: float) -> tuple[tuple[int, int], ...] | None:
            out = []
            first = 0
            for s in range(p):
                left_stages = p - s - 1
                last = first
                if stage_t(s, first, last) > tau or not fits(s, first, last):
                    return None
                while (
                    last + 1 <= L - 1 - left_stages and stage_t(s, first, last + 1) <= tau and fits(s, first, last + 1)
                ):
                    last += 1
                if s == p - 1 and last != L - 1:
                    return None
                out.append((first, last))
                first = last + 1
            return tuple(out)

        return _least_bottleneck(greedy, lambda b: max(stage_t(s, a, z) for s, (a, z) in enumerate(b)),
                                 hi=sum(stage_t(s, 0, L - 1) for s in range(p)))


def _least_bottleneck(split: Callable[[float], tuple[tuple[int, int], ...] | None],
                      bottleneck: Callable[[tuple[tuple[int, int], ...]], float],
                      hi: float) -> tuple[tuple[int, int], ...] | None:
    """The split at the least bottleneck time for which `split(tau)` (monotone: feasible at tau, feasible
    above) finds one. Bisection on tau until the bounds meet, then the split at the bottleneck it found:
    that time is the least feasible one (nothing feasible lies below the infeasible bound), so the
    answer is the split at the exact optimum, with O(log) calls instead of one per candidate time."""
    best = split(hi)
    if best is None:
        return None
    lo = 0.0
    hi = bottleneck(best)
    while hi - lo > 1e-12 * max(hi, 1e-30):
        mid = (lo + hi) / 2
        got = split(mid)
        if got is None:
            lo = mid
        else:
            best, hi = got, min(mid, bottleneck(got))
    return split(hi) or best


def _pareto_front(
    eligible: Sequence[tuple[float, float, tuple[int, ...]]], coupled: bool,
) -> list[tuple[int, ...]]:
    """The usage vectors on the (primary, secondary) Pareto front of `eligible` (sorted by primary):
    up to 32 spread along it when a limit couples time and money, else its two ends."""
    front = []
    low2 = math.inf
    for _p1, p2, u in eligible:
        if p2 < low2 - 1e-12:
            front.append(u)
            low2 = p2
    if coupled and len(front) > 32:
        front = [front[round(j * (len(front) - 1) / 31)] for j in range(32)]
    elif not coupled:
        front = [front[0], front[-1]]
    return front


def _describe_violation(c: Constraints, e: Estimate) -> str:
    v = c.violations(usd_per_iteration=e.usd_per_iteration, usd_per_hour=e.usd_per_hour,
                     iterations_per_s=e.iterations_per_s)
    return "; ".join(v)


def _bounds_from_cuts(cuts: Sequence[int], num_layers: int) -> tuple[tuple[int, int], ...]:
    edges = [0, *cuts, num_layers]
    return tuple((edges[i], edges[i + 1] - 1) for i in range(len(edges) - 1))


def uniform_partition(num_layers: int, p: int) -> tuple[tuple[int, int], ...]:
    """Layers split as evenly as counts allow; the first stages take the extra layer."""
    base, extra = divmod(num_layers, p)
    out = []
    first = 0
    for s in range(p):
        size = base + (1 if s < extra else 0)
        out.append((first, first + size - 1))
        first += size
    return tuple(out)


def balanced_partition(times: Sequence[float], p: int) -> tuple[tuple[int, int], ...] | None:
    """Contiguous split of per-layer times into p parts minimising the largest part (exact DP)."""
    L = len(times)
    if p > L:
        return None
    pre = [0.0]
    for t in times:
        pre.append(pre[-1] + t)
    inf = math.inf
    # f[k][i]: best max over the first i layers in k parts
    f = [[inf] * (L + 1) for _ in range(p + 1)]
    arg = [[0] * (L + 1) for _ in range(p + 1)]
    f[0][0] = 0.0
    for k in range(1, p + 1):
        for i in range(k, L - (p - k) + 1):
            best, at = inf, 0
            for j in range(k - 1, i):
                v = max(f[k - 1][j], pre[i] - pre[j])
                if v < best - 1e-15:
                    best, at = v, j
            f[k][i] = best
            arg[k][i] = at
    cuts = []
    i = L
    for k in range(p, 0, -1):
        j = arg[k][i]
        cuts.append(j)
        i = j
    return _bounds_from_cuts(sorted(cuts)[1:], L)


def _fwd_bwd(v: float | tuple[float, float]) -> tuple[float, float]:
    """A boundary's (forward, back) send seconds from `Costs.p2p_s` (one number: both ways)."""
    return (v, v) if isinstance(v, (int, float)) else v
