"""The planner scale bench (bench/bench_planner_scale.py): its generated store is what the planner reads
(profiles copied from the seed, links by zone class, partial where PARTIAL says, prices and egress by class,
nothing of the seed leaking in), its pools grow as a monotonicity pair must, its ladder pools have the sizes
they name, and a tiny sweep runs end to end through the real planner. Seconds on 2 cores; the bench's own
--quick run is a slow test."""

from __future__ import annotations

import importlib.util
import os
import random
import re
import subprocess
import sys
from collections import Counter

import pytest

from profiles_store import open_store
from profiles_store.store import SEED_DIR
from sailor_cli.options import load_book
from sailor_core.domain import Market
from sailor_core.planner import Objective, plan
from tests.paths import REPO


def _load():  # noqa: ANN202 - the bench is a script, not a package: loaded by its path
    spec = importlib.util.spec_from_file_location("bench_planner_scale", REPO / "bench" / "bench_planner_scale.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


bench = _load()
# us-central1-a, us-west1-b and europe-west4-a are their regions' first zones (where GH-96 has its links)
ZONES = ("us-central1-a", "us-central1-b", "us-west1-b", "us-west1-a", "europe-west4-a")
TYPES = ("A100-40", "V100-16", "GH-96", "A100-80")
MB64 = 64e6


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, int]]:
    uri = str(tmp_path_factory.mktemp("scale") / "store")
    return uri, bench.build_store(uri, zones=ZONES, gpu_types=TYPES)


@pytest.fixture(scope="module")
def book(store):  # noqa: ANN001, ANN201
    return load_book("OPT-350", store[0])  # as `sailor plan --store URI` reads it: the store over the seed


def test_profiles_are_the_seeds_and_nothing_else_of_the_seed_leaks_in(store, book):
    seed = open_store(str(SEED_DIR), seed=False).profile_book("OPT-350", list(TYPES))
    assert set(book.gpu_types) == set(TYPES)
    for g in TYPES:
        assert book.profiled_points(g) and book.profiled_points(g) == seed.profiled_points(g)
        assert all(book.layer_profiles[(g, m, t)] == seed.layer_profiles[(g, m, t)] for m, t in seed.profiled_points(g))
        assert book.intra_node_link(g, 2) == seed.intra_node_link(g, 2) is not None
    assert len(book.links) == store[1]["network_links"]
    assert {lk.sender_zone for lk in book.links} | {lk.receiver_zone for lk in book.links} == set(ZONES)


def test_links_are_partial_where_intended_and_complete_elsewhere(book):
    for a in ZONES:
        for b in ZONES:
            for c in (1, 2, 4):
                assert book.link(a, "A100-40", c, b, "V100-16", c) is not None
    # GH-96 reaches other types only inside a region's first zone, other GH-96 across zones only via such a zone
    assert book.link("us-central1-a", "GH-96", 1, "us-central1-a", "A100-40", 1) is not None
    assert book.link("us-central1-b", "GH-96", 1, "us-central1-b", "A100-40", 1) is None
    assert book.link("us-central1-b", "GH-96", 1, "us-central1-a", "A100-40", 1) is None
    assert book.link("us-central1-b", "GH-96", 4, "us-central1-a", "GH-96", 4) is not None
    assert book.link("us-central1-b", "GH-96", 4, "us-west1-a", "GH-96", 4) is None
    # A100-80: none across continents
    assert book.link("us-central1-a", "A100-80", 1, "us-west1-a", "V100-16", 1) is not None
    assert book.link("us-central1-a", "A100-80", 1, "europe-west4-a", "V100-16", 1) is None
    assert book.link("us-central1-a", "A100-40", 1, "europe-west4-a", "V100-16", 1) is not None


def test_link_fits_follow_the_zone_classes_and_the_slower_end(book):
    seed_links = open_store(str(SEED_DIR), seed=False).profile_book("OPT-350", ["A100-40"])

    def bw(a: str, b: str, ga: str = "A100-40", gb: str = "A100-40") -> float:
        return book.link(a, ga, 1, b, gb, 1).fit.bandwidth_bytes_per_s(MB64)

    # the measured classes are the seed's fits themselves
    for a, b in (("us-central1-a", "us-central1-a"), ("us-central1-a", "us-central1-b"),
                 ("us-central1-a", "us-west1-b")):
        assert book.link(a, "A100-40", 2, b, "A100-40", 2).fit == seed_links.link(a, "A100-40", 2, b, "A100-40", 2).fit
    across = book.link("us-west1-a", "A100-40", 1, "europe-west4-a", "A100-40", 1).fit
    assert across.latency_s > 0 and bw("us-central1-b", "us-central1-a") > bw("us-west1-a", "us-central1-b") > \
        bw("us-west1-a", "europe-west4-a")
    assert bw("us-central1-a", "us-central1-a", gb="V100-16") < bw("us-central1-a", "us-central1-a")
    assert bw("us-central1-a", "us-central1-b", "GH-96", "GH-96") > bw("us-central1-a", "us-central1-b")


def test_egress_and_prices_by_class_and_region(book):
    assert [book.egress_usd_per_gb("us-central1-a", z) for z in ZONES] == [0.0, 0.01, 0.02, 0.02, 0.05]
    us = book.price_usd_per_gpu_hour("us-central1-b", "A100-40", Market.ON_DEMAND)
    assert us == pytest.approx(3.673385)  # the seed's price
    assert book.price_usd_per_gpu_hour("europe-west4-a", "A100-40", Market.ON_DEMAND) == pytest.approx(us * 1.10)
    assert book.price_usd_per_gpu_hour("us-central1-b", "A100-40", Market.SPOT) == pytest.approx(us * 0.35, rel=1e-5)
    assert all(book.price_usd_per_gpu_hour(z, g, Market.ON_DEMAND) for z in ZONES for g in TYPES)


def test_the_planner_finds_a_plan_on_the_generated_store(book):
    entries = [bench.Entry(zone="us-central1-a", gpu_type="A100-40", count=8),
               bench.Entry(zone="us-central1-a", gpu_type="GH-96", count=4),
               bench.Entry(zone="us-central1-b", gpu_type="V100-16", count=8)]
    res = plan(bench.request(book, entries, Objective.MAX_THROUGHPUT), book)
    assert res.plan is not None and res.estimate is not None, res.nearest_miss
    assert res.estimate.throughput_iterations_per_s > 0 and res.estimate.fits_memory


def test_ladder_pools_have_the_size_they_name():
    per_node = {g: t.gpus_per_node for g, t in open_store(str(SEED_DIR), seed=False).gpu_types().items()}
    for zones, types, gpus in ((1, 1, 64), (5, 3, 1000), (20, 5, 4096)):
        entries = bench.ladder_pool(zones, types, gpus, per_node)
        total = sum(e.count for e in entries)
        assert len(entries) == zones * types and gpus - 8 < total <= gpus
        assert {e.zone for e in entries} == set(bench.ZONES[:zones]) and {e.gpu_type for e in entries} == \
            set(bench.TYPES[:types])
        assert all(e.count > 0 and e.count % per_node[e.gpu_type] == 0 for e in entries)
    assert {bench.continent_of(z) for z in bench.ZONES} == {"north-america", "europe", "asia"}


def test_each_pair_only_adds_capacity_and_the_seed_fixes_the_pairs(book):
    pairs = bench.make_pairs(random.Random(5), book, 40, zones=ZONES, types=TYPES)
    assert pairs == bench.make_pairs(random.Random(5), book, 40, zones=ZONES, types=TYPES)
    assert pairs != bench.make_pairs(random.Random(6), book, 40, zones=ZONES, types=TYPES)
    kinds = Counter(p.growth.split(" ")[0].lstrip("+").rstrip("0123456789") or "gpus" for p in pairs)
    assert {"zone", "type", "spot"} <= set(kinds) and sum(kinds.values()) == 40, kinds
    assert sum(any(e.gpu_type == "GH-96" for e in p.large) for p in pairs) >= 10  # partial links, often
    for p in pairs:
        small, large = Counter(), Counter()
        for e in p.small:
            small[e.key] += e.count
        for e in p.large:
            large[e.key] += e.count
        assert all(large[k] >= n for k, n in small.items()) and sum(large.values()) > sum(small.values()), p
        assert sum(small.values()) <= 256 and {e.zone for e in p.large} <= set(ZONES)


def test_a_violation_is_a_worse_plan_beyond_the_tolerance():
    out = bench.Outcome
    fast = out(feasible=True, iterations_per_s=1.0, usd_per_iteration=1.0)
    slow = out(feasible=True, iterations_per_s=0.99, usd_per_iteration=1.01)
    thr, cost = Objective.MAX_THROUGHPUT, Objective.MIN_COST
    assert bench.is_violation(thr, fast, slow, 0.005) and not bench.is_violation(thr, slow, fast, 0.005)
    assert not bench.is_violation(thr, fast, slow, 0.02)  # within the tolerance
    assert bench.is_violation(cost, fast, slow, 0.005) and not bench.is_violation(cost, slow, fast, 0.005)
    assert bench.is_violation(thr, fast, out(), 0.005)  # the larger pool found nothing
    assert not bench.is_violation(thr, out(), slow, 0.005)
    assert not bench.is_violation(thr, fast, out(killed=True), 0.005)


def test_a_tiny_sweep_plans_both_pools_of_each_pair(book):
    pairs = bench.make_pairs(random.Random(3), book, 2, max_gpus=24, zones=ZONES[:3], types=TYPES[:3])
    for p in pairs:
        r = bench.run_pair(p, book, 300.0)
        for o in (r.small, r.large):
            assert not o.killed and not o.error, o
            assert not o.feasible or (o.iterations_per_s > 0 and o.num_gpus > 0 and o.summary)
        assert r.violation == bench.is_violation(p.objective, r.small, r.large, 0.005)
        assert r.searches == 2 + (p.limit_factor is not None)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("SAILOR_SLOW_TESTS") != "1", reason="slow: set SAILOR_SLOW_TESTS=1")
def test_the_quick_run_ends_with_the_issues_line(tmp_path):
    out = tmp_path / "scale.txt"
    p = subprocess.run([sys.executable, "bench/bench_planner_scale.py", "--quick", "--out", str(out)],
                       capture_output=True, text=True, cwd=REPO, timeout=1800)
    last = p.stdout.strip().splitlines()[-1]
    m = re.fullmatch(r"pools=(\d+) slowest_s=([\d.]+) violations=(\d+) worst_gap_pct=([\d.]+|unknown)", last)
    assert m and int(m.group(1)) == 4 + 2 * 20, (last, p.stderr[-2000:])
    assert out.read_text().strip().splitlines()[-1] == last
    assert int(m.group(3)) == 0 or p.returncode == 1  # a violation fails the run
