"""`sailor infra` on aws against moto's server: offerings, dry-run provisioning, provision, cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest

from sailor_cli.main import main
from tests.fakes.moto_server import DUMMY_KEY_ID, DUMMY_SECRET, MotoServer

pytestmark = pytest.mark.aws
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def moto():
    server = MotoServer()
    yield server
    server.stop()


@pytest.fixture
def aws_env(moto, monkeypatch):
    moto.reset()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DUMMY_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DUMMY_SECRET)
    monkeypatch.setenv("SAILOR_AWS_ENDPOINT_URL", moto.url)
    monkeypatch.setenv("SAILOR_AWS_REGIONS", "us-east-1,us-west-2")
    monkeypatch.setenv("SAILOR_AWS_IMAGE_IDS", "us-east-1=ami-dca37ea5,us-west-2=ami-dca37ea5")
    monkeypatch.setenv("SAILOR_AWS_CATALOG", str(DATA / "skypilot_aws_sample.csv"))
    monkeypatch.delenv("SAILOR_GCP_PROJECT", raising=False)
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    return moto


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_offerings_cleanup_and_dry_run_through_the_cli(aws_env, capsys) -> None:
    code, out, _ = run(capsys, "infra", "offerings", "--provider", "aws", "--gpu-type", "A100-40",
                       "--market", "on-demand", "--json")
    assert code == 0
    import json

    offers = json.loads(out)
    # moto offers p4d.24xlarge in several zones; the catalog prices it on demand in us-east-1a and us-west-2b only
    assert {(o["zone"], o["instance_type"]) for o in offers} == {("us-east-1a", "p4d.24xlarge"),
                                                                 ("us-west-2b", "p4d.24xlarge")}
    assert offers[0]["usd_per_gpu_hour"] == pytest.approx(32.7726 / 8)

    code, out, _ = run(capsys, "infra", "provision", "--provider", "aws", "--run", "cli1", "--zone", "us-east-1a",
                       "--gpu-type", "A10G-24", "--count", "2", "--market", "on-demand", "--dry-run")
    # On demand: moto's price list answers 500, so the catalog's price applies (spot would take moto's dummy).
    assert code == 0 and out.count("ec2.RunInstances [us-east-1]") == 2 and "hourly cost: $2.0120/h" in out
    code, out, _ = run(capsys, "infra", "cleanup", "--run", "cli1", "--dry-run")
    assert code == 0 and "would remove 0 resource(s)" in out  # the dry run rented nothing

    code, out, _ = run(capsys, "infra", "provision", "--provider", "aws", "--run", "cli1", "--zone", "us-east-1a",
                       "--gpu-type", "A10G-24", "--count", "2")
    assert code == 0 and out.count(" us-east-1a 1x A10G-24 spot ") == 2
    code, out, _ = run(capsys, "infra", "cleanup", "--provider", "aws", "--dry-run")
    assert "aws: would remove i-" in out and "aws: would remove sg-" in out and "would remove 3 resource(s)" in out
    code, out, _ = run(capsys, "infra", "cleanup", "--provider", "aws", "--run", "cli1")
    assert code == 0 and "removed 3 resource(s)" in out
    code, out, _ = run(capsys, "infra", "cleanup", "--provider", "aws", "--run", "cli1")
    assert "aws: nothing left by run cli1" in out


def test_user_errors_are_one_line_with_a_fix(aws_env, capsys) -> None:
    code, _, err = run(capsys, "infra", "provision", "--provider", "aws", "--run", "x", "--zone", "us-east-1a",
                       "--gpu-type", "B200", "--dry-run")
    assert code == 2 and err.startswith("error: w0: no AWS instance type has 1x B200") and "to fix" in err
    assert "Traceback" not in err
    code, _, err = run(capsys, "infra", "cleanup", "--provider", "azure")
    assert code == 2 and "unknown cloud provider 'azure'" in err


def test_catalog_command_reports_rejected_rows(capsys) -> None:
    code, out, _ = run(capsys, "infra", "catalog", str(DATA / "skypilot_aws_sample.csv"), "--cloud", "aws")
    assert code == 0 and "kept 10 rows, rejected 12" in out and "line 13: Price=0.0 is a placeholder" in out
