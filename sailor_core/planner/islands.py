"""The semi-synchronous planner: which regions train as islands, each island's plan, and H.

Contract: `plan_with_sync(request, book, sync) -> SyncPlanResult` is pure and deterministic. It calls
the synchronous planner (`core.plan`) as a black box: once on the whole pool (the synchronous plan),
and per candidate island on that island's part of the pool with its share of the global batch, then
composes the islands with the simulator's `simulate_islands` (simulator/semisync.py).

- `SyncMode.parse("every-step" | "semi" | "semi:H" | "auto")`. every-step: today's plan, nothing
  else is searched. semi: the best island plan (H chosen, or H given). auto: the synchronous plan and
  the best island plan; the islands are chosen only when they beat it on the request's objective by
  AUTO_MARGIN (a semi-synchronous plan may need more tokens for the same loss; the margin is what it
  must win to be worth that risk), and meet the request's constraints.
- Candidate islands: the pool's regions (after the request's restrictions); every subset of two or
  more of them is a candidate (up to MAX_REGIONS regions; beyond, all of them and each leave-one-out).
  Each GPU also holds its shard's global copy and outer momentum: where they do not fit beside the
  islands' plans, the islands are planned again with that much of every GPU's memory held back.
  An island is planned first at an equal share of the global batch, then again at a share
  proportional to its samples per second, so islands of different speed reach a boundary together
  (the runtime weights their pseudo-gradients by the tokens they trained). The runtime pairs
  islands shard for shard, so islands whose plans differ in shape (stage layers, TP) are refused with
  the reason; the two-region pools of one GPU type plan the same shape.
- H (`choose_inner_steps`): the smallest H >= MIN_INNER_STEPS with which the exposed share of the outer
  step is at most EXPOSED_SHARE of an island's step, at most MAX_INNER_STEPS (DiLoCo's H = 500).
  Smaller H never lost perplexity per token in DiLoCo's sweep (Douillard et al. 2023, fig. 3; H 50 to
  2000), so H is no larger than the links make it.
- `frontier` lists the synchronous frontier and every island candidate side by side (tokens/s, USD
  per million tokens, egress per iteration); `explanation` says what was chosen, what it trades
  (fewer synchronisations, possibly more loss per token) and the rule.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from sailor_core.domain import ResourcePool
from sailor_core.errors import ValidationError
from sailor_core.planner.core import plan as plan_sync
from sailor_core.planner.explain import summarize
from sailor_core.planner.request import Objective, PlanRequest, PlanResult
from sailor_core.profiles import ProfileBook
from sailor_core.semisync import (
    COMPRESSIONS,
    DILOCO_MOMENTUM,
    DILOCO_OUTER_LR,
    IslandPlan,
    OuterSync,
    shape_of,
)
from sailor_core.simulator.core import simulate
from sailor_core.simulator.model import model_for
from sailor_core.simulator.semisync import SemiSyncResult, outer_sync_s, simulate_islands

AUTO_MARGIN = 1.10  # islands must beat the synchronous plan by 10 % on the objective under --sync auto
EXPOSED_SHARE = 0.02  # the outer step may add at most 2 % to an island's step (amortised over H)
MIN_INNER_STEPS = 16
MAX_INNER_STEPS = 500  # DiLoCo's H
MAX_REGIONS = 4  # every subset of up to this many regions is a candidate


@dataclass(frozen=True, kw_only=True)
class SyncMode:
    """How often the plan synchronises: every step, in islands (H chosen or given), or auto."""

    mode: str  # "every-step" | "semi" | "auto"
    inner_steps: int | None = None
    compression: str = "none"
    outer_lr: float = DILOCO_OUTER_LR
    momentum: float = DILOCO_MOMENTUM

    @staticmethod
    def parse(spec: str, *, compression: str = "none", outer_lr: float = DILOCO_OUTER_LR,
              momentum: float = DILOCO_MOMENTUM) -> SyncMode:
        head, _, h = spec.strip().partition(":")
        fix = "to fix: pass --sync every-step, semi, semi:H (H inner steps, e.g. semi:100) or auto"
        if head not in ("every-step", "semi", "auto") or (h and head != "semi"):
            raise ValidationError(f"unknown --sync {spec!r}; {fix}")
        if compression not in COMPRESSIONS:
            raise ValidationError(f"unknown outer compression {compression!r}; to fix: one of "
                                  f"{', '.join(COMPRESSIONS)}")
        try:
            steps = int(h) if h else None
        except ValueError:
            raise ValidationError(f"--sync {spec!r}: H must be a whole number of inner steps; {fix}") from None
        if steps is not None and steps < 1:
            raise ValidationError(f"--sync {spec!r}: H must be at least 1; {fix}")
        OuterSync(inner_steps=1, outer_lr=outer_lr, momentum=momentum)  # refuses bad values, with the fix
        return SyncMode(mode=head, inner_steps=steps, compression=compression, outer_lr=outer_lr, momentum=momentum)

    def outer(self, inner_steps: int) -> OuterSync:
        return OuterSync(inner_steps=inner_steps, outer_lr=self.outer_lr, momentum=self.momentum,
                         compression=self.compression)


@dataclass(frozen=True, kw_only=True)
class IslandCandidate:
    """One set of regions as islands: its plan and estimate, or why it cannot run."""

    regions: tuple[str, ...]
    plan: IslandPlan | None
    estimate: SemiSyncResult | None
    why_not: str = ""


@dataclass(frozen=True, kw_only=True)
class SyncPlanResult:
    """The synchronous answer, the island candidates, and which one was chosen."""

    mode: SyncMode
    synchronous: PlanResult
    candidates: tuple[IslandCandidate, ...]
    chosen: IslandCandidate | None  # None: the synchronous plan
    explanation: str

    @property
    def sync_label(self) -> str:
        return "every-step" if self.chosen is None or self.chosen.plan is None else \
            f"semi:{self.chosen.plan.sync.inner_steps}"

    def frontier(self) -> list[dict[str, Any]]:
        """Synchronous and semi-synchronous plans side by side (see the module's contract)."""
        book_tokens = _tokens_per_iteration(self)
        rows = [{"sync": "every-step", "iterations_per_s": f.iterations_per_s,
                 "tokens_per_s": f.iterations_per_s * book_tokens,
                 "usd_per_million_tokens": f.usd_per_iteration / book_tokens * 1e6 if book_tokens else 0.0,
                 "usd_per_iteration": f.usd_per_iteration, "egress_usd_per_iteration": None,
                 "num_gpus": f.num_gpus, "summary": f.summary, "chosen": f.chosen and self.chosen is None}
                for f in self.synchronous.frontier]
        if self.synchronous.estimate is not None:
            for r in rows:
                if r["chosen"] or (self.chosen is not None and r["iterations_per_s"] ==
                                   self.synchronous.estimate.throughput_iterations_per_s):
                    r["egress_usd_per_iteration"] = self.synchronous.estimate.egress_usd_per_iteration
        for c in self.candidates:
            if c.plan is None or c.estimate is None:
                continue
            e = c.estimate
            rows.append({"sync": f"semi:{c.plan.sync.inner_steps}", "iterations_per_s": e.throughput_iterations_per_s,
                         "tokens_per_s": e.tokens_per_s, "usd_per_million_tokens": e.usd_per_million_tokens,
                         "usd_per_iteration": e.usd_per_iteration,
                         "egress_usd_per_iteration": e.egress_usd_per_iteration,
                         "num_gpus": e.num_gpus, "summary": summarize_islands(c.plan),
                         "chosen": c is self.chosen})
        return rows


def _tokens_per_iteration(r: SyncPlanResult) -> float:
    e = r.synchronous.estimate
    return e.tokens_per_s / e.throughput_iterations_per_s if e is not None and e.throughput_iterations_per_s else 0.0


def summarize_islands(ip: IslandPlan) -> str:
    parts = [f"[{p.stages[0].replicas[0].region}: {summarize(p)}]" for p in ip.islands]
    s = ip.sync
    return (f"{len(ip.islands)} islands, outer step every {s.inner_steps} steps "
            f"({s.compression}{f', {s.fragments} fragments' if s.fragments > 1 else ''}) " + " ".join(parts))


def choose_inner_steps(inner_step_s: float, outer_s: float, fragments: int = 1) -> int:
    """The smallest H >= MIN_INNER_STEPS whose exposed outer share, fragments x outer_s / H, is at most
    EXPOSED_SHARE of an inner step; at most MAX_INNER_STEPS (see the module's contract)."""
    need = math.ceil(fragments * outer_s / (EXPOSED_SHARE * inner_step_s)) if inner_step_s > 0 else MAX_INNER_STEPS
    h = min(MAX_INNER_STEPS, max(MIN_INNER_STEPS, need))
    return h + (-h) % fragments


def _regions(pool: ResourcePool) -> list[str]:
    return sorted({e.region for e in pool.entries if e.gpus > 0})


def _region_sets(regions: list[str]) -> list[tuple[str, ...]]:
    if len(regions) <= MAX_REGIONS:
        return [c for k in range(len(regions), 1, -1) for c in itertools.combinations(regions, k)]
    return [tuple(regions)] + [tuple(r for r in regions if r != x) for x in regions]


class _Islands:
    """Plans islands for one request, memoising each (region, batch share, memory held back) plan."""

    def __init__(self, request: PlanRequest, book: ProfileBook, mode: SyncMode) -> None:
        self.request, self.book, self.mode = request, book, mode
        self.pool = request.restrictions.apply(request.pool)
        self._memo: dict[tuple[str, int, int], PlanResult] = {}
        self._books: dict[int, ProfileBook] = {0: book}

    def region_plan(self, region: str, batch: int, reserve: int = 0) -> PlanResult:
        """The synchronous planner's answer for `region` at `batch`, with `reserve` bytes of every GPU held
        back (for the global copy and the outer momentum)."""
        key = (region, batch, reserve)
        if key not in self._memo:
            if reserve not in self._books:
                self._books[reserve] = replace(self.book, gpu_types={
                    g: replace(t, memory_bytes=max(0, t.memory_bytes - reserve))
                    for g, t in self.book.gpu_types.items()})
            sub = ResourcePool(entries=tuple(e for e in self.pool.entries if e.region == region))
            opts = replace(self.request.options, wide_frontier=False)
            self._memo[key] = plan_sync(replace(self.request, pool=sub, global_batch_size=batch, options=opts),
                                        self._books[reserve])
        return self._memo[key]

    def candidate(self, regions: tuple[str, ...], reserve: int = 0) -> IslandCandidate:
        """The islands of `regions`: planned at equal shares, then at shares by speed; planned once more
        with each GPU's outer state held back when it does not fit beside them."""
        g = self.request.global_batch_size
        if g < len(regions):
            return IslandCandidate(regions=regions, plan=None, estimate=None,
                                   why_not=f"a global batch of {g} cannot be shared by {len(regions)} islands")
        first = [self.region_plan(r, b, reserve) for r, b in zip(regions, _shares(g, [1.0] * len(regions)),
                                                                  strict=True)]
        if any(p.estimate is None for p in first):
            bad = [r for r, p in zip(regions, first, strict=True) if p.estimate is None]
            return IslandCandidate(regions=regions, plan=None, estimate=None, why_not=f"no plan in {', '.join(bad)}")
        speed = [p.estimate.samples_per_s for p in first if p.estimate is not None]
        results = [self.region_plan(r, b, reserve) for r, b in zip(regions, _shares(g, speed), strict=True)]
        if any(p.plan is None for p in results):
            results = first
        plans = tuple(p.plan for p in results if p.plan is not None)
        if len({shape_of(p) for p in plans}) > 1 or None in {shape_of(p) for p in plans}:
            return IslandCandidate(regions=regions, plan=None, estimate=None, why_not=(
                "the islands' best plans differ in shape (stage layers, TP): "
                + "; ".join(f"{r}: {summarize(p)}" for r, p in zip(regions, plans, strict=True))))
        c = self._with_h(regions, plans)
        if c.estimate is not None and not c.estimate.fits_memory and not reserve:
            return self.candidate(regions, reserve=c.estimate.outer_state_bytes)
        return c

    def _with_h(self, regions: tuple[str, ...], plans: tuple[Any, ...]) -> IslandCandidate:
        m = self.mode
        probe = IslandPlan(islands=plans, sync=m.outer(1))
        inner = max(simulate(p, self.book).iteration_time_s for p in plans)
        h = m.inner_steps or choose_inner_steps(inner, outer_sync_s(probe, model_for(self.book)))
        ip = IslandPlan(islands=plans, sync=m.outer(h))
        est = simulate_islands(ip, self.book)
        c = self.request.constraints
        broken = c.violations(usd_per_iteration=est.usd_per_iteration, usd_per_hour=est.usd_per_hour,
                              iterations_per_s=est.throughput_iterations_per_s)
        if not est.fits_memory:
            broken.append(f"the global copy and outer momentum ({est.outer_state_bytes / 2**30:.2f} GiB per GPU) "
                          f"do not fit beside the islands' own state")
        return IslandCandidate(regions=regions, plan=ip if not broken else None, estimate=est,
                               why_not="; ".join(broken))


def _shares(total: int, weights: list[float]) -> list[int]:
    """`total` split in proportion to `weights`, each at least 1, adding up to `total` (largest remainder)."""
    s = sum(weights) or 1.0
    raw = [total * w / s for w in weights]
    out = [max(1, int(x)) for x in raw]
    while sum(out) < total:
        out[max(range(len(out)), key=lambda i: raw[i] - out[i])] += 1
    while sum(out) > total:
        out[max(range(len(out)), key=lambda i: out[i] - raw[i])] -= 1
    return out


def _better(objective: Objective, a: SemiSyncResult, b: Any, margin: float = 1.0) -> bool:
    """Whether estimate `a` beats `b` on the objective by `margin`."""
    if objective in (Objective.MAX_THROUGHPUT, Objective.MAX_GOODPUT):
        return bool(a.throughput_iterations_per_s >= margin * b.throughput_iterations_per_s)
    if objective == Objective.MIN_COST_PER_TOKEN:
        return bool(a.usd_per_million_tokens * margin <= b.usd_per_million_tokens)
    return bool(a.usd_per_iteration * margin <= b.usd_per_iteration)


def plan_with_sync(request: PlanRequest, book: ProfileBook, mode: SyncMode) -> SyncPlanResult:
    """The plan for `request` under the sync mode (see the module's contract)."""
    synchronous = plan_sync(request, book)
    if mode.mode == "every-step":
        return SyncPlanResult(mode=mode, synchronous=synchronous, candidates=(), chosen=None,
                              explanation=synchronous.explanation)
    planner = _Islands(request, book, mode)
    candidates = tuple(planner.candidate(rs) for rs in _region_sets(_regions(planner.pool)))
    feasible = [c for c in candidates if c.plan is not None and c.estimate is not None]
    best = None
    for c in feasible:
        assert c.estimate is not None
        if best is None or (best.estimate is not None and _better(request.objective, c.estimate, best.estimate)):
            best = c
    chosen = best
    if mode.mode == "auto" and best is not None and synchronous.estimate is not None and best.estimate is not None:
        chosen = best if _better(request.objective, best.estimate, synchronous.estimate, AUTO_MARGIN) else None
    return SyncPlanResult(mode=mode, synchronous=synchronous, candidates=candidates, chosen=chosen,
                          explanation=_explain(request, synchronous, candidates, chosen, best, mode))


def _explain(request: PlanRequest, synchronous: PlanResult, candidates: tuple[IslandCandidate, ...],
             chosen: IslandCandidate | None, best: IslandCandidate | None, mode: SyncMode) -> str:
    """What was chosen, what it trades, and the rule (see the module's contract)."""
    lines = []
    s = synchronous.estimate
    if chosen is not None and chosen.plan is not None and chosen.estimate is not None:
        e, h = chosen.estimate, chosen.plan.sync.inner_steps
        lines.append(f"Chosen: {len(chosen.plan.islands)} islands ({', '.join(chosen.regions)}) that synchronise "
                     f"every {h} steps: {e.throughput_iterations_per_s:.4f} it/s, {e.usd_per_iteration:.4f} "
                     f"USD/iteration, egress {e.egress_usd_per_iteration:.5f} USD/iteration.")
        if s is not None:
            lines.append(f"Synchronous plan: {s.throughput_iterations_per_s:.4f} it/s, {s.usd_per_iteration:.4f} "
                         f"USD/iteration, egress {s.egress_usd_per_iteration:.5f} USD/iteration "
                         f"(x{e.throughput_iterations_per_s / s.throughput_iterations_per_s:.2f} throughput, "
                         f"egress /{s.egress_usd_per_iteration / max(e.egress_usd_per_iteration, 1e-12):.0f}).")
        lines.append(f"Traded: the islands all-reduce pseudo-gradients once per {h} steps instead of gradients "
                     f"every step (DiLoCo, Douillard et al. 2023: comparable loss per token at H up to 500 with an "
                     f"outer Nesterov step), which may cost some loss per token; the outer step adds "
                     f"{e.outer_exposed_s:.3f} s per iteration. H is the smallest with at most "
                     f"{EXPOSED_SHARE:.0%} of a step exposed (at least {MIN_INNER_STEPS}, at most {MAX_INNER_STEPS}).")
    else:
        lines.append(synchronous.explanation)
        if mode.mode == "auto" and best is not None and best.estimate is not None and s is not None:
            lines.append(f"Islands considered: best {', '.join(best.regions)} at "
                         f"{best.estimate.throughput_iterations_per_s:.4f} it/s, not {AUTO_MARGIN:.2f}x better than "
                         f"synchronous on {request.objective.value}: kept every-step synchronisation.")
    missing = [f"{'+'.join(c.regions)}: {c.why_not}" for c in candidates if c.plan is None and c.why_not]
    if missing:
        lines.append("Island candidates left out: " + "; ".join(missing))
    if not candidates and mode.mode != "every-step":
        lines.append("Islands need GPUs in at least two regions; the pool has one.")
    return "\n".join(lines)

