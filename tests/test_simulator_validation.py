"""The simulator against the 15 measured GH200 runs, and `sailor simulate` end to end.

The measured runs and the profiles they are simulated with ship in tests/data (unchanged published
files, tests/data/README-eth-easl-sailor.md), so these tests run in a plain clone.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from sailor_cli.main import main as cli_main
from tests.paths import MEASURED_RUNS, PUBLISHED_DATA

VALIDATION = MEASURED_RUNS
MEASURED_RUN_COUNT = 15  # the published clariden/OPT-350 set: N = 1..32 nodes of 4 GH200

# Accuracy gates on the 15 measured runs (|simulated / measured - 1|), the simulator issue's targets,
# set below the published reference simulator's own error on this set as measured by this project
# (../shared/reference_data/README.md, section on the validation runs: time mean 8.9 %, max 16.1 %;
# memory mean 5.9 %, max 8.8 %). Ours, measured (`python bench/validate_simulator.py`, docs/results.md):
# time mean 5.6 %, memory mean 1.5 %, max 11.9 % (N4_D4's time), so the margins are 0.4, 3.5 and 0.1 points.
TIME_MEAN_ABS_ERR_GATE = 0.06
MEMORY_MEAN_ABS_ERR_GATE = 0.05
MAX_ABS_ERR_GATE = 0.12  # over every run, time and memory
MEMORY_UNDER_GATE = 0.02  # a plan judged to fit must fit: no run's peak more than this under the measured one


@pytest.fixture(scope="module")
def book():  # type: ignore[no-untyped-def]
    from profiles_store.eth_easl import read_eth_easl

    return read_eth_easl(PUBLISHED_DATA).profile_book("OPT-350")


def test_error_on_the_measured_runs_meets_the_targets(book) -> None:  # type: ignore[no-untyped-def]
    from sailor_core.plan_format import load_plan_file
    from sailor_core.simulator import SimOptions, simulate

    errs = []
    for f in sorted(glob.glob(str(VALIDATION / "**" / "plan_config_*.json"), recursive=True)):
        meas = json.load(open(f))
        # the published runs ran on DeepSpeed, whose communication the simulator models as such
        r = simulate(load_plan_file(f, fmt="eth-easl", model="OPT-350"), book, options=SimOptions(runtime="deepspeed"))
        errs.append((abs(r.iteration_time_s / meas["real"] - 1), abs(r.peak_memory_bytes / meas["max_mem"] - 1)))
        assert r.fits_memory
        assert r.peak_memory_bytes >= meas["max_mem"] * (1 - MEMORY_UNDER_GATE), f
    assert len(errs) == MEASURED_RUN_COUNT
    assert sum(e[0] for e in errs) / len(errs) <= TIME_MEAN_ABS_ERR_GATE
    assert sum(e[1] for e in errs) / len(errs) <= MEMORY_MEAN_ABS_ERR_GATE
    assert max(max(e) for e in errs) <= MAX_ABS_ERR_GATE


def test_the_shipped_seed_simulates_the_measured_runs_as_the_published_files_do(book) -> None:  # type: ignore[no-untyped-def]
    """The default store (the shipped seed) and the published files give one answer on every run."""
    from profiles_store.store import SEED_DIR, open_store
    from sailor_core.plan_format import load_plan_file
    from sailor_core.simulator import SimOptions, simulate

    seed = open_store(str(SEED_DIR), seed=False).profile_book("OPT-350", ["GH-96"])
    for f in sorted(VALIDATION.glob("**/plan_config_*.json")):
        plan = load_plan_file(str(f), fmt="eth-easl", model="OPT-350")
        a, b = (simulate(plan, bk, options=SimOptions(runtime="deepspeed")) for bk in (book, seed))
        assert (a.iteration_time_s, a.peak_memory_bytes) == pytest.approx((b.iteration_time_s, b.peak_memory_bytes),
                                                                           rel=1e-9), f.name


def _plan(name: str) -> str:
    return str(next(iter(sorted(VALIDATION.glob(f"**/plan_config_{name}.json")))))


def test_cli_json_has_the_documented_keys(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["simulate", _plan("N8_D4"), "--format", "eth-easl", "--model", "OPT-350", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    for k in ("iteration_time_s", "throughput_iterations_per_s", "tokens_per_s", "peak_memory_bytes", "fits_memory",
              "usd_per_iteration", "breakdown", "per_stage"):
        assert k in d
    assert len(d["per_stage"]) == 2 * 4
    assert d["throughput_iterations_per_s"] == pytest.approx(1 / d["iteration_time_s"])


def test_cli_readable_output(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["simulate", _plan("N4_D1"), "--format", "eth-easl", "--model", "OPT-350"])
    out = capsys.readouterr().out
    assert rc == 0 and "iteration time" in out and "peak memory" in out and "GH-96" in out


def test_cli_missing_profile_and_invalid_plan(tmp_path: os.PathLike[str], capsys: pytest.CaptureFixture[str]) -> None:
    d = json.load(open(_plan("N2_D1")))
    d["mbs"] = 3  # no GH-96 profile at mbs 3
    f = os.path.join(tmp_path, "p.json")
    json.dump(d, open(f, "w"))
    rc = cli_main(["simulate", f, "--format", "eth-easl", "--model", "OPT-350", "--json"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "model=OPT-350" in err and "gpu_type=GH-96" in err and "mbs=3" in err and "tp=4" in err
    assert "sailor profile" in err
    ours = {
        "format": "sailor-plan", "version": 1, "model": "OPT-350", "global_batch_size": 64,
        "stages": [{"layers": [0, 10], "replicas": [{"gpu_type": "GH-96", "gpus_per_node": 4, "zone": "us-central1-a",
                                                     "tp": 8}]},
                   {"layers": [12, 25], "replicas": [{"gpu_type": "GH-96", "gpus_per_node": 4, "zone": "us-central1-a",
                                                      "tp": 4}]}],
        "pipelines": [{"microbatch_size": 8, "num_microbatches": 4}],
    }
    g = os.path.join(tmp_path, "ours.json")
    json.dump(ours, open(g, "w"))
    rc = cli_main(["simulate", g])
    err = capsys.readouterr().err
    assert rc == 2
    assert (
        "stage 1 starts at layer 12" in err and "tp=8 is larger than a node" in err and "global_batch_size is 64" in err
    )


def test_cli_store_may_be_a_folder_of_published_data_and_schedule_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", _plan("N8_D2"), "--format", "eth-easl", "--model", "OPT-350", "--json"]
    assert cli_main(args + ["--store", str(PUBLISHED_DATA)]) == 0
    one = json.loads(capsys.readouterr().out)
    assert cli_main(args + ["--store", str(PUBLISHED_DATA), "--schedule", "gpipe"]) == 0
    gp = json.loads(capsys.readouterr().out)
    assert one["schedule"] == "1f1b" and gp["schedule"] == "gpipe"
    # GPipe keeps every microbatch in flight: more memory than 1F1B's p - s
    assert gp["peak_memory_bytes"] > one["peak_memory_bytes"]
