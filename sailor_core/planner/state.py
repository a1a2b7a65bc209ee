"""What one search has found so far: the only mutable state of the search, in one object.

Contract: `SearchState` holds the incumbent (the best score that meets every limit, whose
tolerance cutoff is the pruning bound), the best candidates (feasible first, by score), the
near-best by the other goal, the fast or cheap candidates that break a limit (the local search's
seeds), the nearest miss, every estimated point (for the frontier), the sketches and placements
already estimated, the counters and the patience over stage counts. `record` is the one way a
candidate enters it; `best` is the answer, best first. Nothing here estimates or scores: the
caller passes each candidate with its constraint gap (`scoring.Goal`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

from sailor_core.planner.scoring import Goal
from sailor_core.planner.space import Candidate, Point, Sketch

KEEP_VIOLATORS = 16  # limit-breaking candidates kept as local-search seeds, of each kind
CLOSE_GAP = 0.02  # a candidate this far (relative) past a limit still competes: the simulator has the final word


@dataclass
class Counters:
    configurations: int = 0
    assignments: int = 0
    candidates: int = 0
    pruned: int = 0
    unplaced: int = 0  # sketches that could not be placed in their slots' zones or estimated (no link profile)


class SearchState:
    def __init__(self, goal: Goal, keep: int) -> None:
        self.goal = goal
        self.keep = keep
        self.counters = Counters()
        self.points: list[Point] = []  # every estimated plan, for the frontier
        self.incumbent = math.inf
        self.nearest: tuple[float, str] | None = None  # smallest gap seen, and its reason
        self.round_best = math.inf  # the best feasible score of the current stage count
        self.round_fits = False  # whether some split of the current stage count fits in memory anywhere
        self._best: list[tuple[float, int, Candidate]] = []  # max-heap on score via negation
        self._near: list[tuple[float, float, int, Candidate]] = []  # (secondary, score, tie, c) within tolerance
        self._violators: list[tuple[float, int, Candidate]] = []  # best scores that break a limit
        self._closest: list[tuple[float, int, Candidate]] = []  # smallest breaches of a limit
        self._seen: set[Sketch] = set()
        self._placed: set[tuple[object, ...]] = set()
        self._tie = 0

    @property
    def cutoff(self) -> float:
        """Scores at or above this cannot be chosen: the pruning bound every lower bound is held against."""
        return self.goal.cutoff(self.incumbent)

    def first_sight(self, sk: Sketch) -> bool:
        """True the first time a sketch comes up (and marks it seen)."""
        if sk in self._seen:
            return False
        self._seen.add(sk)
        return True

    def first_placement(self, placed: tuple[object, ...]) -> bool:
        """True the first time a placed plan comes up: placements that put every replica in the same
        zones (a zone rotation or a pipeline-major fill on one zone) are one plan."""
        if placed in self._placed:
            return False
        self._placed.add(placed)
        return True

    def record(self, cand: Candidate, gap: float, why: Callable[[], str]) -> None:
        """Take in an estimated candidate `gap` past the limits (`why`: the limits it breaks, in words)."""
        e = cand.estimate
        self.points.append(Point(e.iterations_per_s, e.usd_per_iteration, cand.sketch))
        if gap <= 0:
            self.round_best = min(self.round_best, cand.score)
        else:
            if self.nearest is None or gap < self.nearest[0]:
                self.nearest = (gap, why())
            # Fast (or cheap) plans that break a limit seed the local pass: one changed stage
            # (a zone, a cheaper GPU) may bring them within it.
            self._tie += 1
            _push_bounded(self._violators, (-cand.score, -self._tie, cand), KEEP_VIOLATORS)
            _push_bounded(self._closest, (-gap, -self._tie, cand), KEEP_VIOLATORS)
            if gap > CLOSE_GAP:
                return
        self._tie += 1
        # heap of the best `keep` (largest score on top) by (feasible-first, score)
        key = (1.0 if gap > 0 else 0.0) * 1e18 + cand.score
        _push_bounded(self._best, (-key, -self._tie, cand), self.keep)
        if gap <= 0:
            self.incumbent = min(self.incumbent, cand.score)
            self._keep_near(cand)

    def _keep_near(self, cand: Candidate) -> None:
        """Keep the best candidates by the other goal among those within the tolerance of the incumbent."""
        if cand.score > self.cutoff:
            return
        self._near.append((self.goal.other(cand.estimate), cand.score, self._tie, cand))
        if len(self._near) > 2 * self.keep:
            cut = self.cutoff
            self._near = sorted(x for x in self._near if x[1] <= cut)[: self.keep]

    def best(self) -> list[Candidate]:
        """Best first: within the tolerance of the best score by the other goal, then by score."""
        cut = self.cutoff
        near = [c for _, score, _, c in sorted(self._near) if score <= cut]
        items = sorted(self._best, key=lambda t: (-t[0], -t[1]))
        return list({c.sketch: c for c in near + [c for _, _, c in items]}.values())

    def seeds(self) -> list[Candidate]:
        """The limit-breaking candidates kept for the local search: the best scores, then the smallest gaps."""
        return ([c for _, _, c in sorted(self._violators, key=lambda t: (-t[0], -t[1]))]
                + [c for _, _, c in sorted(self._closest, key=lambda t: (-t[0], -t[1]))])

    def progress(self) -> tuple[float, float]:
        """(best score, then the best other goal within the tolerance): lower is progress."""
        near = [sec for sec, score, _, _ in self._near if score <= self.cutoff]
        return self.incumbent, min(near, default=math.inf)

    def end_round(self, slack: float) -> bool | None:
        """Close a (microbatch size, stage count): whether its best feasible score is more than `slack`
        (relative) above the incumbent (a miss of the patience rule), None when none of its splits fits in
        memory (no miss: deeper pipelines hold less per GPU, and the rule that more stages only add
        bubbles and sends holds only once memory is served)."""
        missed = self.round_best > self.incumbent * (1 + slack) if self.round_fits else None
        self.round_best = math.inf
        self.round_fits = False
        return missed


def _push_bounded(heap: list[tuple[float, int, Candidate]], item: tuple[float, int, Candidate], size: int) -> None:
    """Push onto a heap that keeps its `size` largest-keyed items (the smallest popped first)."""
    heapq.heappush(heap, item)
    if len(heap) > size:
        heapq.heappop(heap)
