"""The planner's time budget (`SearchOptions.max_search_s`, `sailor plan --max-search-s`): the search stops
when the budget ends, keeps the best plan it found and proves how far from the best one-kind plan it may be.

- Without a budget the search covers its space: gap 0, optimal.
- With a budget far too short to search the space it still answers with a plan (never before it holds
  one that meets the limits), and its gap is a bound: the unbudgeted optimum is no better than the
  budgeted plan shrunk by (1 + gap).
- The passes the budget ended before are named, and the answer is then not called optimal.
- `sailor plan --max-search-s` says "optimal" or "within x %" and puts the gap in --json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from profiles_store.store import open_store
from sailor_core.domain import Capacity, Market, ResourcePool
from sailor_core.planner import PlanRequest, PlanResult, SearchOptions, plan
from sailor_core.planner.assign import Option
from sailor_core.profiles import ProfileBook

ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f")
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def book(tmp_path_factory: pytest.TempPathFactory) -> ProfileBook:
    return open_store(str(tmp_path_factory.mktemp("store"))).profile_book("OPT-350")


def _pool(book: ProfileBook) -> ResourcePool:
    """Four zones of A100-40 x16 and V100-16 x32: a search of about a second with no budget."""
    entries = []
    for zone in ZONES:
        for gpu, n in (("A100-40", 16), ("V100-16", 32)):
            per_vm = book.gpu_types[gpu].gpus_per_node
            entries.append(Capacity(zone=zone, region="us-central1", gpu_type=gpu, gpus=n, gpus_per_vm=per_vm,
                                    usd_per_gpu_hour=book.price_usd_per_gpu_hour(zone, gpu, Market.ON_DEMAND)))
    return ResourcePool(entries=tuple(entries))


def _request(book: ProfileBook, budget_s: float | None) -> PlanRequest:
    return PlanRequest(model="OPT-350", global_batch_size=1024, pool=_pool(book),
                       options=SearchOptions(max_search_s=budget_s))


@pytest.fixture(scope="module")
def whole(book: ProfileBook) -> PlanResult:
    return plan(_request(book, None), book)


def test_without_a_budget_the_search_covers_its_space(whole: PlanResult) -> None:
    r = whole
    assert r.plan is not None
    assert r.stats.gap == 0.0 and r.stats.optimal and r.stats.skipped == ()
    assert "every plan of the searched space covered or ruled out" in r.explanation


def test_a_short_budget_answers_with_a_plan_and_a_gap_that_bounds_the_optimum(book: ProfileBook,
                                                                             whole: PlanResult) -> None:
    short = plan(_request(book, 1e-3), book)
    assert short.plan is not None and short.estimate is not None and whole.estimate is not None
    assert not short.stats.optimal
    assert short.stats.skipped, short.stats  # the passes after the single-kind search did not run
    assert "not searched: " in short.explanation and "budget" in short.explanation
    gap = short.stats.gap
    assert gap is not None and gap >= 0.0
    # the proven gap: no one-kind plan of the pool runs an iteration faster than the budgeted one / (1 + gap)
    assert whole.estimate.iteration_time_s >= short.estimate.iteration_time_s / (1 + gap) * (1 - 1e-9), (
        whole.estimate.iteration_time_s, short.estimate.iteration_time_s, gap)


def test_a_budget_longer_than_the_search_changes_nothing(book: ProfileBook, whole: PlanResult) -> None:
    roomy = plan(_request(book, 600.0), book)
    assert roomy.plan == whole.plan and roomy.stats.optimal


def test_sailor_plan_says_optimal_or_within(tmp_path: Path, book: ProfileBook) -> None:
    pool = tmp_path / "pool.yaml"
    gpus = "    gpus:\n      A100-40: {count: 16}\n      V100-16: {count: 32}\n"
    pool.write_text("zones:\n" + "".join(f"  {z}:\n{gpus}" for z in ZONES))

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sailor_cli.main", "plan", "--pool", str(pool), "--model",
                               "OPT-350", "--global-batch-size", "1024", "--store", str(tmp_path / "store"), *extra],
                              capture_output=True, text=True, cwd=REPO, timeout=300)

    full = run()
    assert full.returncode == 0, full.stderr[-2000:]
    assert "optimal" in full.stdout, full.stdout[-2000:]
    short = run("--max-search-s", "0.001", "--json")
    assert short.returncode == 0, short.stderr[-2000:]
    doc = json.loads(short.stdout)
    assert doc["stats"]["optimal"] is False and doc["stats"]["gap"] is not None
    assert doc["search"].startswith("within "), doc["search"]
    bad = run("--max-search-s", "-1")
    assert bad.returncode == 2 and bad.stderr.count("\n") <= 2, bad.stderr


def _wide_dp() -> tuple[list[list[Option]], tuple[int, ...]]:
    """Six stages, each free to take tp 1 or 2 in any of 8 slots: tens of thousands of usages."""
    options = [[Option(g, tp, 1.0 + g / 10 + tp, float(tp)) for g in range(8) for tp in (1, 2)] for _ in range(6)]
    return options, (12,) * 8


def test_the_dp_gives_up_when_the_deadline_passes_inside_it() -> None:
    """A pool of many zones and types reaches millions of DP states at a high threshold (20 zones x 5
    types: 12 s in one DP against a 10 s budget); the DP reads the deadline as it goes."""
    from sailor_core.planner.assign import STOP_EVERY, usage_dp
    options, caps = _wide_dp()
    looks = []

    def stop() -> bool:
        looks.append(1)
        return len(looks) >= 2

    assert usage_dp(options, caps, stop=lambda: False) is not None
    assert usage_dp(options, caps, stop=stop) is None
    assert len(looks) == 2  # it stopped at the second look, STOP_EVERY states after the first
    assert sum(len(layer) for layer in usage_dp(options, caps).layers) > 2 * STOP_EVERY


@pytest.mark.parametrize("max_gpus", [None, 20])
def test_the_copies_the_dp_keeps_are_those_of_each_usage(max_gpus: int | None) -> None:
    """`DP.fits` is kept incrementally (a parent's copies, the grown slot, the GPU cap); `end_states`
    reads it instead of recounting millions of usages: it must equal `copies` for every state."""
    from sailor_core.planner.assign import copies, usage_dp
    from sailor_core.planner.picks import end_states
    options, caps = _wide_dp()
    dp = usage_dp(options, caps, max_gpus=max_gpus, live=[1])
    assert dp is not None and dp.fits
    assert all(d == copies(u, caps, max_gpus) for u, d in dp.fits.items())
    assert end_states(dp.last, caps, max_gpus, dp.fits) == end_states(dp.last, caps, max_gpus)
