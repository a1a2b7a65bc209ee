"""Domain types validate on construction and plans list every violation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor_core.domain import (
    BandwidthFit,
    Capacity,
    Market,
    ParallelPlan,
    PipelineBatch,
    Replica,
    ResourcePool,
    Stage,
    default_region,
    split_batch,
)
from sailor_core.errors import ValidationError
from sailor_core.plan_format import (
    PlanFormatError,
    load_plan_file,
    plan_from_dict,
    plan_to_dict,
    save_plan_file,
)
from tests.paths import MEASURED_RUNS as VALIDATION


def two_stage_plan(**kw) -> ParallelPlan:
    rep = Replica(gpu_type="A100-40", zone="us-central1-a", tp=2, gpus_per_node=4)
    args = dict(
        model="OPT-350",
        global_batch_size=16,
        stages=(
            Stage(first_layer=0, last_layer=12, replicas=(rep, rep)),
            Stage(first_layer=13, last_layer=25, replicas=(rep, rep)),
        ),
        pipelines=(PipelineBatch(microbatch_size=2, num_microbatches=4),) * 2,
    )
    args.update(kw)
    return ParallelPlan(**args)


def test_regions_from_zone_names() -> None:
    assert default_region("us-central1-a") == "us-central1"
    assert default_region("us-east-1a") == "us-east-1"
    assert default_region("local") == "local"


def test_market_parse_rejects_unknown_with_choices() -> None:
    assert Market.parse("SPOT") is Market.SPOT
    with pytest.raises(ValidationError, match="on-demand, spot"):
        Market.parse("reserved")


def test_pool_rejects_duplicate_entries() -> None:
    e = Capacity(zone="z-a", region="z", gpu_type="A100-40", gpus=4)
    with pytest.raises(ValidationError, match="twice"):
        ResourcePool(entries=(e, e))


def test_valid_plan_has_no_violations() -> None:
    assert two_stage_plan().violations(26) == []


def test_invalid_plan_is_refused_on_construction_with_every_violation() -> None:
    rep = Replica(gpu_type="A100-40", zone="us-central1-a", tp=8, gpus_per_node=4)
    with pytest.raises(ValidationError) as e:
        two_stage_plan(
            stages=(Stage(first_layer=0, last_layer=10, replicas=(rep,)),
                    Stage(first_layer=12, last_layer=25, replicas=(rep, rep))),
            global_batch_size=17,
            schedule="zigzag",
        )
    text = str(e.value)
    assert "expected 11" in text  # layers do not tile
    assert "1 replicas but the plan has 2 pipelines" in text
    assert "larger than a node" in text
    assert "global_batch_size is 17" in text
    assert "schedule must be" in text
    assert "; to fix: " in text and "docs/formats.md" in text


def test_plan_checked_against_a_models_layer_count() -> None:
    problems = two_stage_plan().violations(30)
    assert problems == ["stages cover layers 0..25 but model OPT-350 has 30 layers"]


@pytest.mark.parametrize(
    ("make", "part"),
    [
        (
            lambda: Stage(first_layer=3, last_layer=2, replicas=(Replica(gpu_type="A", zone="z-a"),)),
            "first_layer <= last_layer",
        ),
        (
            lambda: Stage(first_layer=-1, last_layer=2, replicas=(Replica(gpu_type="A", zone="z-a"),)),
            "0 <= first_layer",
        ),
        (lambda: Stage(first_layer=0, last_layer=2, replicas=()), "no replicas"),
        (lambda: PipelineBatch(microbatch_size=0, num_microbatches=4), "must be >= 1"),
        (lambda: PipelineBatch(microbatch_size=2, num_microbatches=0), "must be >= 1"),
        (lambda: Replica(gpu_type="A", zone="z-a", tp=0), "tp must be >= 1"),
        (lambda: Replica(gpu_type="A", zone="z-a", gpus_per_node=0), "gpus_per_node must be >= 1"),
        (lambda: Replica(gpu_type="", zone="z-a"), "non-empty"),
        (lambda: two_stage_plan(stages=()), "no stages"),
        (lambda: two_stage_plan(pipelines=()), "0 replicas|2 replicas but the plan has 0"),
        (lambda: two_stage_plan(precision="fp8"), "precision must be"),
    ],
)
def test_plan_parts_are_validated_on_construction(make, part) -> None:
    with pytest.raises(ValidationError, match=part) as e:
        make()
    assert "to fix: " in str(e.value)


def test_split_batch_is_exact_and_balanced() -> None:
    parts = split_batch(1024, [4] * 20)
    assert sum(p.samples for p in parts) == 1024
    assert max(p.num_microbatches for p in parts) == 13 and min(p.num_microbatches for p in parts) == 12
    mixed = split_batch(48, [4, 2])
    assert sum(p.samples for p in mixed) == 48
    assert mixed[0].num_microbatches * 4 > mixed[1].num_microbatches * 2  # bigger microbatches carry more


def test_bandwidth_fit_is_clamped_to_measured_max() -> None:
    fit = BandwidthFit(coeffs=(0.0, 0.0, 100.0), max_bytes_per_s=2e9)
    assert fit.bandwidth_bytes_per_s(1e9) == 2e9
    assert fit.transfer_time_s(2e9) == pytest.approx(1.0)
    assert fit.transfer_time_s(0) == 0.0


def test_plan_round_trips_through_json(tmp_path: Path) -> None:
    plan = two_stage_plan()
    assert plan_from_dict(plan_to_dict(plan)) == plan
    path = tmp_path / "plan.json"
    save_plan_file(plan, path)
    assert load_plan_file(path) == plan


def test_plan_file_errors_are_explained(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanFormatError, match="not valid JSON"):
        load_plan_file(bad)
    d = plan_to_dict(two_stage_plan())
    d["version"] = 99
    bad.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError, match="version 99"):
        load_plan_file(bad)


def test_every_published_plan_imports_with_exact_batch() -> None:
    files = sorted(VALIDATION.rglob("plan_config_*.json"))
    assert len(files) == 15
    for f in files:
        raw = json.loads(f.read_text())
        plan = load_plan_file(f, fmt="eth-easl", model="OPT-350")
        assert plan.violations(26) == []
        assert plan.num_stages == raw["pipeline_list"][0]["num_stages"]
        assert plan.global_batch_size == raw["gbs"]


def test_published_plan_needs_a_model(tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"pipeline_list": [], "mbs": 1, "gbs": 1}))
    with pytest.raises(PlanFormatError, match="--model"):
        load_plan_file(f)


def test_bandwidth_fit_is_not_extrapolated_below_the_measured_sizes() -> None:
    # A fit that dives below zero for tiny messages (a < 0) must not predict a 100x slow-down.
    fit = BandwidthFit(coeffs=(-0.5, 0.0, 10.0), max_bytes_per_s=20e9)
    at_64k = fit.bandwidth_bytes_per_s(64 * 2**10)
    assert fit.bandwidth_bytes_per_s(4 * 2**10) == pytest.approx(at_64k)
    assert at_64k > 1e9
