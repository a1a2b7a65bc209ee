"""The search kernel: which GPUs, how many, and how to split the model, scored by one cost model.

Contract: `Search(problem, costs).run()` is a pure, deterministic function of its inputs (the
`Costs` protocol: the simulator's building blocks in production, synthetic costs in tests). It
returns estimated candidates (`Candidate`), best first for the objective, plus every estimated
point for the frontier (`state.points`). It never builds a `ParallelPlan`; `core.plan`
materialises and verifies the winners with the full simulator.

The plan space (a sketch, `space.Sketch`): microbatch size b, P stages with a contiguous layer
partition, D data-parallel pipelines, and per stage one replica shape k_s = (slot, tp) shared by
its D replicas (zones of a region pooled in a slot; the replicas fill the slot's zones in order).

The search is a pipeline of pure steps, each in its own module, driven here; per (b, P, partition):
1. shapes: the partitions worth trying and a stage table: for every stage and slot the
   tensor-parallel degrees that are profiled, fit in memory with the 1F1B in-flight microbatches,
   and the per-microbatch time of each (shapes.py);
2. a sweep over the bottleneck time tau (ascending, over the table's times): each stage takes, in
   each slot, the smallest TP whose time is <= tau (the paper's "smallest TP that fits, larger
   only if it pays": a larger TP appears only once tau needs it);
3. assign: a dynamic program over stages whose state is the GPUs used per slot (per pipeline) and
   whose value is the cheapest assignment reaching it; the end states give, for every D, the
   cheapest assignment that D copies fit in the pool, and the best once each boundary's send floor
   counts (the keys see compute and price, not which choice keeps a pipeline in one region; assign.py);
4. D runs over the smallest degree of each distinct microbatch count ceil(n/D) (a larger D with
   the same count only adds GPUs and ring length: paper heuristic; shapes.d_values);
5. place, cost, score: each (assignment, D) is placed in zones (placement.py), estimated with the
   simulator's own composition (1F1B pipeline time, gradient rings per stage, optimizer, prices,
   egress; estimate.py), scored (scoring.py) and kept in the search's state (state.py) if it
   beats the bound.
Lower bounds (bounds.py: time, the exact 1F1B schedule's bound with the best stage times, some
stage at tau and the cheapest messages; cost, that time x the cheapest GPUs) prune whole
configurations and stop the tau sweep; a sketch's own bound (its stage times, and for the picks
the send floor adds, its kinds' send floors) prunes it before placement. After the sweep, the
best sketches are re-partitioned: the layers are re-balanced for the chosen GPUs (min-max stage
time, memory-checked), which the published planner never does (it splits uniformly); then other
zone fills and a network-aware local search (one stage on another GPU kind, two stages swapping
kinds) polish them.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from sailor_core.planner.assign import State, stage_options, usage_dp
from sailor_core.planner.bounds import DepthFloors, Floor, RingTails, SketchFloors, bounds_at, floor_of
from sailor_core.planner.costs import Costs
from sailor_core.planner.estimate import Placements, estimate
from sailor_core.planner.links import LinkFloors
from sailor_core.planner.picks import end_states, fronts, reconstruct
from sailor_core.planner.placement import fill_variants
from sailor_core.planner.scoring import SECONDS_PER_HOUR, Goal
from sailor_core.planner.shapes import (
    Bounds,
    StageTable,
    d_values,
    kind_changes,
    partitions,
    rebalanced,
    stage_table,
)
from sailor_core.planner.space import Candidate, Problem, Sketch
from sailor_core.planner.state import SearchState


@dataclass(eq=False)
class _Split:
    """One (microbatch size, split) of the search and how far its bottleneck sweep has come: the
    stage table, the lower-bound terms, the D values, the ascending thresholds and the next one's index."""

    mbs: int
    bounds: Bounds
    table: StageTable
    floor: Floor
    n: int
    d_list: list[int]
    taus: list[float]
    k: int = 0
    at: list[float] | None = None  # the bound at each D of the next threshold (`bounds.bounds_at`)


def _same_slots(a: Problem, b: Problem) -> bool:
    """Whether two problems' slots are the same GPUs in the same zones, whatever their counts, and their
    profiled TPs the same: what link and ring floors depend on."""
    return a.tp_values == b.tp_values and len(a.slots) == len(b.slots) and all(
        (x.index, x.gpu_type, x.gpus_per_node, x.region, x.zone_regions, x.usd_per_gpu_hour)
        == (y.index, y.gpu_type, y.gpus_per_node, y.region, y.zone_regions, y.usd_per_gpu_hour)
        and [z for z, _ in x.zones] == [z for z, _ in y.zones] for x, y in zip(a.slots, b.slots, strict=True))


def _part_of(part: Problem, whole: Problem) -> bool:
    """Whether `part`'s slots are `whole`'s with some emptied and the others as they are (GPUs per zone)."""
    return _same_slots(part, whole) and all(
        not x.capacity or x.zones == y.zones for x, y in zip(part.slots, whole.slots, strict=True))


# "Near-best" for patience: a stage count whose best plan comes within 5 % of the best so far (algorithmic choice).
PATIENCE_SLACK = 0.05


class Search:
    """One search over a problem's plan space: the steps composed, the state kept in `state`."""

    def __init__(self, problem: Problem, costs: Costs, *, incumbent: float = math.inf,
                 shared: Search | None = None, deadline: float | None = None) -> None:
        """`incumbent`: the best score another search of the same request found; the bounds prune
        against it from the first sketch on (candidates must come within the tolerance of it).
        `shared`: a search of the same request over the same slots (their GPU counts may differ: a part
        of the pool) whose memos of link, ring and sketch floors this one reuses, and whose deadline it
        keeps unless given one. `deadline`: when the search stops (`time.perf_counter()` seconds)."""
        self.problem = problem
        self.costs = costs
        self.goal = Goal.of_problem(problem)
        self.state = SearchState(self.goal, problem.keep)
        self.state.incumbent = incumbent
        self.deadline: float = deadline if deadline is not None else (
            shared.deadline if shared is not None else math.inf)
        # the least score anything the deadline left unsearched could have (inf: nothing was left)
        self.unsearched = math.inf
        self._caps = tuple(s.capacity for s in problem.slots)
        self._total_gpus = min(sum(self._caps), problem.max_gpus or sum(self._caps))
        self._links: LinkFloors  # each boundary's cheapest sends
        self._rings: RingTails  # stage 0's least gradient ring per D
        self._floors: SketchFloors  # each sketch's D-free terms
        if shared is not None and shared.costs is costs and _same_slots(shared.problem, problem):
            self._links, self._rings = shared._links, shared._rings
            self._floors = SketchFloors(problem, costs, self.goal, self._links, self._rings, shared._floors)
        else:
            self._links, self._rings = LinkFloors(problem, costs), RingTails(problem, costs)
            self._floors = SketchFloors(problem, costs, self.goal, self._links, self._rings)
        self.depths = DepthFloors(problem, costs, self.goal)  # bounds of whole stage counts
        whole = shared.placements if shared is not None and _part_of(problem, shared.problem) else None
        self.placements: Placements = Placements(problem, costs, shared=whole)

    # -- the sweep ---------------------------------------------------------------------------
    def run(self) -> list[Candidate]:
        """Every microbatch size (least depth floor first) and stage count (until patience runs out), then the polish
        passes; what the deadline leaves unsearched is bounded in `unsearched`."""
        pb, st = self.problem, self.state
        max_p = min(pb.max_stages, pb.num_layers)
        sizes = [mbs for mbs in sorted(pb.mbs_values, reverse=True) if pb.global_batch_size % mbs == 0]
        # Microbatch sizes by their least floor over the stage counts, ties largest first: a size that cannot
        # come near (a large microbatch that needs ten stages on a big pool: small D, huge DPs) goes last.
        floors = {m: min((self.depths.floor(m, p) for p in range(pb.min_stages, max_p + 1)), default=math.inf)
                  for m in sizes}
        sizes.sort(key=lambda m: (floors[m], -m))
        for i, mbs in enumerate(sizes):
            misses = 0
            for p in range(pb.min_stages, max_p + 1):
                if self.out_of_time():
                    self._left_out([(mbs, q) for q in range(p, max_p + 1)]
                                   + [(m, q) for m in sizes[i + 1:] for q in range(pb.min_stages, max_p + 1)])
                    return st.best()
                for bounds, even in partitions(pb, self.costs, p, mbs):
                    sp = self._split(mbs, bounds)
                    if sp is not None:
                        self._sweep([sp])
                    st.round_fits |= sp is not None and even
                # Patience: deeper pipelines only add bubbles and sends once memory and GPU types
                # are served (an even split fits: one packed to memory does not serve them, its first
                # stages are crowded); stop after `patience` stage counts in a row that come nowhere near.
                missed = st.end_round(PATIENCE_SLACK)
                if missed is not None:
                    misses = misses + 1 if missed else 0
                if pb.patience and misses >= pb.patience:
                    break
        self.rebalance_pass()
        self.local_pass()
        return st.best()

    def out_of_time(self) -> bool:
        """Whether the time budget has ended: never before the search holds a plan that meets every limit
        (an answer past the budget beats none on the recovery path; a pool with no such plan is searched whole)."""
        return (self.deadline < math.inf and math.isfinite(self.state.incumbent)
                and time.perf_counter() >= self.deadline)

    def _left_out(self, depths: Sequence[tuple[int, int]]) -> None:
        """Bound what the deadline leaves unsearched: these (microbatch size, stage count) whole."""
        self.unsearched = min([self.unsearched, *(self.depths.floor(mbs, p) for mbs, p in depths)])

    def run_split(self, mbs: int, bounds: Bounds) -> list[Candidate]:
        """The bottleneck sweep of one (microbatch size, split) alone, no polish: the best candidates on it."""
        sp = self._split(mbs, bounds)
        self._sweep([sp] if sp is not None else [])
        return self.state.best()

    def _split(self, mbs: int, bounds: Bounds) -> _Split | None:
        """A split ready to sweep; None when some stage fits in memory nowhere or no D fits the pool."""
        pb = self.problem
        self.state.counters.configurations += 1
        table = stage_table(pb, self.costs, mbs, bounds)
        if table is None:
            return None
        n = pb.global_batch_size // mbs
        lb = floor_of(pb, self.costs, self._links, mbs, bounds, table, self._rings)
        min_gpus = sum(min(tp for row in stage for tp, _ in row) for stage in table)
        d_list = d_values(n, max(1, self._total_gpus // max(1, min_gpus)))
        if not d_list:
            return None
        slowest_best = max(lb.best)
        taus = sorted({t for stage in table for row in stage for _, t in row if t >= slowest_best})
        return _Split(mbs=mbs, bounds=bounds, table=table, floor=lb, n=n, d_list=d_list, taus=taus)

    def _bound(self, sp: _Split) -> float:
        """The least score anything of a split's thresholds not yet swept can have."""
        if sp.k >= len(sp.taus):
            return math.inf
        at = bounds_at(self.goal, sp.taus[sp.k], sp.floor, sp.n, sp.d_list)
        # A D whose bound is at the cutoff stays there: the bound grows with the threshold, the cutoff never does.
        cut = self.state.cutoff
        keep = [i for i, b in enumerate(at) if b < cut]
        if len(keep) < len(at):
            sp.d_list, at = [sp.d_list[i] for i in keep], [at[i] for i in keep]
        sp.at = at
        return min(at, default=math.inf)

    def _sweep(self, splits: Sequence[_Split]) -> None:
        """Sweep the splits' thresholds best first (least lower bound; a split's thresholds in ascending
        order), until the least bound left is at the cutoff (nothing left can come within the tolerance of
        the incumbent) or the deadline passes (what is left is bounded in `unsearched`)."""
        st = self.state
        heap: list[tuple[float, int, _Split]] = [(self._bound(x), i, x) for i, x in enumerate(splits)]
        heapq.heapify(heap)
        while heap and heap[0][0] < st.cutoff:
            if self.out_of_time():
                self.unsearched = min(self.unsearched, heap[0][0])
                return
            at, i, sp = heapq.heappop(heap)
            self._step(sp)
            if self.out_of_time():  # mid-step: the rest of this threshold's picks are bounded by its bound
                self.unsearched = min(self.unsearched, at, heap[0][0] if heap else math.inf)
                return
            b = self._bound(sp)
            if b < st.cutoff:
                heapq.heappush(heap, (b, i, sp))
        st.counters.pruned += len(heap)

    def _step(self, sp: _Split) -> None:
        """The DP at the split's next threshold, then on to the one after (thresholds within
        `Problem.tau_step` of the next are covered by it when a split has many)."""
        pb, st = self.problem, self.state
        tau = sp.taus[sp.k]
        sp.k += 1
        # Thresholds within tau_step of the next one are covered by it (its options include
        # theirs but for a TP the next one no longer needs): at most that much on the bottleneck.
        if len(sp.taus) > 48 and sp.k < len(sp.taus) and sp.taus[sp.k] <= tau * (1 + pb.tau_step):
            return
        at = sp.at if sp.at is not None else bounds_at(self.goal, tau, sp.floor, sp.n, sp.d_list)
        self._assign(sp.mbs, sp.bounds, sp.table, tau, sp.n,
                     [d for d, b in zip(sp.d_list, at, strict=True) if b < st.cutoff], sp.floor)

    def _assign(self, mbs: int, bounds: Bounds, table: StageTable, tau: float, n: int, d_list: list[int],
                lb: Floor) -> None:
        """The DP over stages at bottleneck tau, and each of its fronts' sketches that the bound lets through;
        `d_list`: the copies (D) whose bound at tau is below the cutoff (the DP drops paths that fit fewer)."""
        st = self.state
        st.counters.assignments += 1
        options = stage_options(self.problem, table, tau, self.goal.speed_first)
        if options is None:
            return
        # cost objectives: a boundary's egress counts in the price key, at one microbatch per tau
        tolls = () if self.goal.speed_first else [self._links.tolls(mbs, last) for _, last in bounds[:-1]]
        dp = usage_dp(options, self._caps, lb.pairs, self.goal.speed_first, self.problem.max_gpus, d_list,
                      tolls, SECONDS_PER_HOUR / tau if tau > 0 else 0.0, stop=self.out_of_time,
                      price_ceiling=math.inf if self.goal.speed_first else self._price_ceiling(tau, n))
        if dp is None or self.out_of_time():
            return
        ends = end_states(dp.last, self._caps, self.problem.max_gpus, dp.fits)
        memo: dict[State, tuple[tuple[int, int], ...]] = {}

        def kinds_of(u: State) -> tuple[tuple[int, int], ...]:
            k = memo.get(u)
            if k is None:
                k = memo[u] = reconstruct(dp.layers, u)
            return k

        for picks in fronts(self.problem, self.goal, ends, tau, n, d_list, lb, lambda: st.cutoff):
            if self.out_of_time():
                return
            # The front's picks are bounded with the cheapest sends between any kinds, not their own:
            # one that cannot win on its own split may still seed the re-split (rebalance_pass) of its
            # kinds (fig8b-80+240 lost its 0.3795 it/s plan when its own sends pruned the seed). The
            # picks the send floor adds are bounded with their own sends: only those that can win.
            taken = set(picks.front)
            ranked = (u for u in picks.ranked if u not in taken)
            todo = [(u, False) for u in dict.fromkeys(picks.front)]
            todo += [(u, True) for u in dict.fromkeys(picks.with_sends + picks.by_types)]
            while todo and not self.out_of_time():
                pick, with_sends = todo.pop(0)
                kinds = kinds_of(pick)
                # A placement already known to fail is not bounded again; any other pick is bounded before
                # it is placed (bounding costs less than placing).
                if self.placements.known_unplaceable(kinds, picks.d):
                    st.counters.unplaced += 1
                elif self._floors.score(mbs, bounds, kinds, picks.d, n, st.cutoff, sends=with_sends) >= st.cutoff:
                    st.counters.pruned += 1
                    continue
                else:
                    unplaced = st.counters.unplaced
                    self.consider(Sketch(mbs=mbs, bounds=bounds, kinds=kinds, dp=picks.d))
                    if st.counters.unplaced == unplaced:
                        continue
                if not with_sends:
                    # Missing links rule out only the plans that need them: the next state by the keys
                    # makes way for a pick that cannot be placed or estimated (no profile between its zones);
                    # those already known not to place make way at once.
                    for nxt in ranked:
                        if not self.placements.known_unplaceable(kinds_of(nxt), picks.d):
                            todo.insert(0, (nxt, False))
                            break
                        st.counters.unplaced += 1

    def _price_ceiling(self, tau: float, n: int) -> float:
        """Cost objectives: the most USD per hour one pipeline (egress included) may cost and beat the cutoff
        with a bottleneck of tau: each of D pipelines pays for the whole iteration, at least ceil(n / D) x tau
        (its bottleneck stage computes every microbatch of the fullest pipeline), so D x that >= n tau."""
        busy = n * tau
        return self.goal.usd_within(self.state.cutoff) * SECONDS_PER_HOUR / busy if busy > 0 else math.inf

    def consider(self, sk: Sketch) -> Candidate | None:
        """Place, estimate and score a sketch once, and record it; None when it is not a new, placeable plan."""
        pb, st = self.problem, self.state
        if not st.first_sight(sk):
            return None
        if pb.max_gpus is not None and sk.dp * sum(tp for _, tp in sk.kinds) > pb.max_gpus:
            return None
        layouts = self.placements.of(sk)
        if layouts is None:
            st.counters.unplaced += 1
            return None
        if not st.first_placement((sk.mbs, sk.bounds, sk.kinds, sk.dp, layouts)):
            return None
        e = estimate(pb, self.costs, sk, layouts)
        st.counters.candidates += 1
        if e is None or not math.isfinite(e.iteration_s):
            st.counters.unplaced += 1
            return None  # no zone room, or a link without a network profile
        cand = Candidate(sketch=sk, estimate=e, score=self.goal.of(e))
        st.record(cand, self.goal.gap(e), lambda: self.goal.why_not(e))
        return cand

    def best(self) -> list[Candidate]:
        """Best first: within the tolerance of the best score by the other goal, then by score."""
        return self.state.best()

    # -- polish ------------------------------------------------------------------------------
    def rebalance_pass(self) -> None:
        """Re-split the layers of the best sketches for the GPUs they chose (heterogeneous min-max), then
        try their other zone fills (placement.fill_variants)."""
        for cand in self.state.best():
            sk = cand.sketch
            if sk.num_stages < 2 or self.out_of_time():
                continue
            b = rebalanced(self.problem, self.costs, sk)
            if b is not None and b != sk.bounds:
                self.consider(Sketch(mbs=sk.mbs, bounds=b, kinds=sk.kinds, dp=sk.dp))
        for cand in self.state.best():
            for variant in fill_variants(self.problem.slots, cand.sketch):
                self.consider(variant)

    def local_pass(self, top: int = 8, rounds: int = 4) -> None:
        """Network-aware polish: the DP sees compute, memory and price only, so among equally fast
        choices (the same GPU in two zones at different prices) it cannot tell which keeps pipeline
        sends and gradient rings inside a zone. Try, on the best sketches and the limit-breaking
        seeds, every other GPU kind on one stage and every swap of two stages' kinds, scored by the
        full estimate."""
        st = self.state
        for _ in range(rounds):
            if self.out_of_time():
                return
            before = st.progress()
            for cand in st.best()[:top] + st.seeds():
                for sk in kind_changes(self.problem, self.costs, cand.sketch):
                    self._neighbor(sk, cand)
            if st.progress() >= before:
                break

    def _neighbor(self, sk: Sketch, seed: Candidate) -> None:
        """Consider a neighbour; if it looks promising, also with its layers re-split for its GPUs."""
        c = self.consider(sk)
        if c is None or sk.num_stages < 2:
            return
        v = self.goal.gap(c.estimate)
        promising = (v <= 0 and c.score <= self.state.incumbent * 1.1) or (0 < v < self.goal.gap(seed.estimate))
        if promising or self.problem.num_layers <= 12:  # re-splitting a small model is cheap: always
            b = rebalanced(self.problem, self.costs, sk)
            if b is not None and b != sk.bounds:
                self.consider(Sketch(mbs=sk.mbs, bounds=b, kinds=sk.kinds, dp=sk.dp, placement=sk.placement))
