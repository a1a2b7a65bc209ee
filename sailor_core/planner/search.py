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

import math

from sailor_core.planner.assign import end_states, fronts, reconstruct, stage_options, usage_dp
from sailor_core.planner.bounds import Floor, LinkFloors, SketchFloors, bounds_at, floor_of
from sailor_core.planner.costs import Costs
from sailor_core.planner.estimate import estimate
from sailor_core.planner.placement import fill_variants, place
from sailor_core.planner.scoring import SECONDS_PER_HOUR, Goal
from sailor_core.planner.shapes import Bounds, StageTable, d_values, kind_changes, partitions, rebalanced, stage_table
from sailor_core.planner.space import Candidate, Problem, Sketch
from sailor_core.planner.state import SearchState


class Search:
    """One search over a problem's plan space: the steps composed, the state kept in `state`."""

    def __init__(self, problem: Problem, costs: Costs, *, incumbent: float = math.inf) -> None:
        """`incumbent`: the best score another search of the same request found; the bounds prune
        against it from the first sketch on (candidates must come within the tolerance of it)."""
        self.problem = problem
        self.costs = costs
        self.goal = Goal.of_problem(problem)
        self.state = SearchState(self.goal, problem.keep)
        self.state.incumbent = incumbent
        self._caps = tuple(s.capacity for s in problem.slots)
        self._total_gpus = min(sum(self._caps), problem.max_gpus or sum(self._caps))
        self._links = LinkFloors(problem, costs)  # memo of each boundary's cheapest sends
        self._floors = SketchFloors(problem, costs, self.goal, self._links)  # memo of each sketch's D-free terms

    # -- the sweep ---------------------------------------------------------------------------
    def run(self) -> list[Candidate]:
        """Every microbatch size and stage count (until patience runs out), then the polish passes."""
        pb, st = self.problem, self.state
        max_p = min(pb.max_stages, pb.num_layers)
        for mbs in sorted(pb.mbs_values, reverse=True):
            if pb.global_batch_size % mbs:
                continue
            st.start_stage_counts()
            for p in range(pb.min_stages, max_p + 1):
                for bounds, even in partitions(pb, self.costs, p, mbs):
                    st.counters.configurations += 1
                    st.round_fits |= self.sweep(mbs, bounds) and even
                # Patience: deeper pipelines only add bubbles and sends once memory and GPU types
                # are served (an even split fits: one packed to memory does not serve them, its first
                # stages are crowded); stop after `patience` stage counts in a row that come nowhere near.
                misses = st.end_round(pb.patience_slack)
                if pb.patience and misses >= pb.patience:
                    break
        self.rebalance_pass()
        self.local_pass()
        return st.best()

    def sweep(self, mbs: int, bounds: Bounds) -> bool:
        """The bottleneck sweep of one (microbatch size, split): ascending tau until the bound stops it.
        False when some stage of the split fits in memory nowhere."""
        pb, st = self.problem, self.state
        table = stage_table(pb, self.costs, mbs, bounds)
        if table is None:
            return False
        n = pb.global_batch_size // mbs
        lb = floor_of(pb, self.costs, self._links, mbs, bounds, table)
        min_gpus = sum(min(tp for row in stage for tp, _ in row) for stage in table)
        d_list = d_values(n, max(1, self._total_gpus // max(1, min_gpus)))
        if not d_list:
            return True
        slowest_best = max(lb.best)
        taus = sorted({t for stage in table for row in stage for _, t in row if t >= slowest_best})
        # Merging thresholds only pays (and only risks) when there are many of them.
        step = pb.tau_step if len(taus) > 48 else 0.0
        for k, tau in enumerate(taus):
            at = bounds_at(self.goal, tau, lb, n, d_list)
            if min(at) >= st.cutoff:
                st.counters.pruned += 1
                break
            # Thresholds within tau_step of the next one are covered by it (its options include
            # theirs but for a TP the next one no longer needs): at most that much on the bottleneck.
            if step and k + 1 < len(taus) and taus[k + 1] <= tau * (1 + step):
                continue
            self._assign(mbs, bounds, table, tau, n, [d for d, b in zip(d_list, at, strict=True) if b < st.cutoff], lb)
        return True

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
                      tolls, SECONDS_PER_HOUR / tau if tau > 0 else 0.0)
        if dp is None:
            return
        layers, states = dp
        ends = end_states(states, self._caps, self.problem.max_gpus)
        for d, front, network in fronts(self.problem, self.goal, ends, tau, n, d_list, lb, lambda: st.cutoff):
            # The front's picks are bounded with the cheapest sends between any kinds, not their own:
            # one that cannot win on its own split may still seed the re-split (rebalance_pass) of its
            # kinds (fig8b-80+240 lost its 0.3795 it/s plan when its own sends pruned the seed). The
            # picks the send floor adds are bounded with their own sends: only those that can win.
            picks = [(u, False) for u in dict.fromkeys(front)] + [(u, True) for u in dict.fromkeys(network)]
            for pick, with_sends in picks:
                kinds = reconstruct(layers, pick)
                if self._floors.score(mbs, bounds, kinds, d, n, st.cutoff, sends=with_sends) >= st.cutoff:
                    st.counters.pruned += 1
                    continue
                self.consider(Sketch(mbs=mbs, bounds=bounds, kinds=kinds, dp=d))

    def consider(self, sk: Sketch) -> Candidate | None:
        """Place, estimate and score a sketch once, and record it; None when it is not a new, placeable plan."""
        pb, st = self.problem, self.state
        if not st.first_sight(sk):
            return None
        if pb.max_gpus is not None and sk.dp * sum(tp for _, tp in sk.kinds) > pb.max_gpus:
            return None
        layouts = place(pb.slots, sk)
        if layouts is None or not st.first_placement((sk.mbs, sk.bounds, sk.kinds, sk.dp, layouts)):
            return None
        e = estimate(pb, self.costs, sk, layouts)
        st.counters.candidates += 1
        if e is None or not math.isfinite(e.iteration_s):
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
            if sk.num_stages < 2:
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
