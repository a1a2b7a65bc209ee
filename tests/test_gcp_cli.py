"""`sailor infra` on gcp against the local Compute fake: offerings, dry run, provision, cleanup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sailor_cli.main import main
from tests.fakes.gce_fake import GceFake

pytestmark = pytest.mark.gcp
DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def fake():
    f = GceFake(project="cli-project").start()
    yield f
    f.stop()


@pytest.fixture
def gcp_env(fake, monkeypatch):
    fake.reset()
    monkeypatch.setenv("SAILOR_GCP_PROJECT", "cli-project")
    monkeypatch.setenv("SAILOR_GCE_ENDPOINT", fake.endpoint)
    monkeypatch.setenv("SAILOR_GCP_REGIONS", "us-central1,europe-west4")
    monkeypatch.setenv("SAILOR_GCP_LIVE_PRICES", "0")
    monkeypatch.setenv("SAILOR_GCP_CATALOG", str(DATA / "skypilot_gcp_sample.csv"))
    return fake


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_offerings_provision_and_cleanup_through_the_cli(gcp_env, capsys) -> None:
    code, out, _ = run(capsys, "infra", "offerings", "--provider", "gcp", "--gpu-type", "V100-16", "--json")
    assert code == 0
    offers = {(o["zone"], o["instance_type"], o["market"]): o for o in json.loads(out)}
    v = offers[("us-central1-a", "n1-standard-8+nvidia-tesla-v100:1", "spot")]
    assert v["usd_per_gpu_hour"] == pytest.approx(0.82) and v["count"] == v["gpus"] == 8

    code, out, _ = run(capsys, "infra", "provision", "--provider", "gcp", "--run", "cli2", "--zone", "us-central1-a",
                       "--gpu-type", "V100-16", "--dry-run")
    assert code == 0 and "compute.instances.insert [us-central1-a]" in out and '"provisioningModel": "SPOT"' in out
    assert "hourly cost: $0.8200/h" in out and gcp_env.instances == {}

    gcp_env.exhausted.add("us-central1-a")
    code, out, _ = run(capsys, "infra", "provision", "--provider", "gcp", "--run", "cli2", "--zone", "us-central1-a",
                       "--gpu-type", "V100-16")
    assert code == 0 and "capacity fallback: w0 us-central1-a -> us-central1-b (us-central1-a " \
                         "(ZONE_RESOURCE_POOL_EXHAUSTED))" in out
    code, out, _ = run(capsys, "infra", "cleanup", "--dry-run")  # gcp is configured: covered without --provider
    assert (
        "gcp: would remove us-central1-b/sailor-cli2-w0" in out
        and "gcp: would remove firewall/sailor-cli2-ports" in out
    )
    code, out, _ = run(capsys, "infra", "cleanup", "--provider", "gcp", "--run", "cli2")
    assert code == 0 and "removed 2 resource(s)" in out and gcp_env.instances == {} and gcp_env.firewalls == {}
