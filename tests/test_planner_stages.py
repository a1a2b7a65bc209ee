"""`sailor plan --stages N | A-B`: the planner restricted to a number (or range) of pipeline stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor_core.domain import Capacity, ResourcePool
from sailor_core.errors import ValidationError
from sailor_core.planner import PlanRequest, SearchOptions, plan
from sailor_core.planner.request import stage_range
from tests.planner_fixtures import MODEL, tiny_book


def test_stage_range_reads_a_number_or_a_range() -> None:
    assert stage_range("3") == (3, 3)
    assert stage_range(" 2-4 ") == (2, 4)
    for bad in ("0", "4-2", "two", "2-", "-3"):
        with pytest.raises(ValidationError, match="--stages"):
            stage_range(bad)
    with pytest.raises(ValidationError, match="min_stages"):
        SearchOptions(min_stages=3, max_stages=2)


def test_every_plan_has_the_stage_count_asked_for() -> None:
    book = tiny_book(5, num_blocks=4)
    pool = ResourcePool(entries=tuple(
        Capacity(zone="r1-a", region="r1", gpu_type=g, gpus=8, gpus_per_vm=2, usd_per_gpu_hour=p)
        for g, p in (("fast", 3.0), ("slow", 1.0))))
    free = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool), book)
    assert free.plan is not None
    for k in (1, 2, 3):
        r = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool,
                             options=SearchOptions(min_stages=k, max_stages=k)), book)
        assert r.plan is not None and r.plan.num_stages == k, (k, r.nearest_miss)
        # the frontier's points are plans of the same search space
        assert r.estimate is not None and r.estimate.fits_memory
    lo_hi = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool,
                             options=SearchOptions(min_stages=2, max_stages=3)), book)
    assert lo_hi.plan is not None and 2 <= lo_hi.plan.num_stages <= 3
    too_many = plan(PlanRequest(model=MODEL, global_batch_size=16, pool=pool,
                                options=SearchOptions(min_stages=9, max_stages=9)), book)
    assert too_many.plan is None and "fewer than the 9 pipeline stages" in too_many.nearest_miss


def test_cli_plan_stages(tmp_path: Path, capsys) -> None:
    from sailor_cli.main import main

    pool = tmp_path / "pool.yaml"
    pool.write_text("zones:\n  us-central1-a:\n    gpus:\n      A100-40: {count: 16}\n")
    args = ["plan", "--pool", str(pool), "--model", "OPT-350", "--global-batch-size", "128", "--json",
            "--store", str(tmp_path / "store")]
    for spec, allowed in (("2", {2}), ("3-4", {3, 4})):
        assert main([*args, "--stages", spec]) == 0
        got = json.loads(capsys.readouterr().out)
        assert len(got["plan"]["stages"]) in allowed, (spec, got["plan"]["stages"])
    assert main([*args, "--stages", "4-2"]) == 2
    assert "--stages" in capsys.readouterr().err
