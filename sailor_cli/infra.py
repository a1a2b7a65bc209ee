"""`sailor infra`: cloud offerings, catalogs, dry-run provisioning and cleanup of what runs left.

Contract:
- `offerings --provider aws|gcp [--region R]... [--gpu-type G]... [--market M]... [--json]` prints
  what can be rented now, per zone, with the price per GPU-hour and when it was fetched.
- `catalog FILE --cloud aws|gcp [--json]` imports a SkyPilot-format catalog CSV and prints what
  was kept and each rejected row with its reason.
- `provision --provider P --run RUN --zone Z --gpu-type G [--gpus N] [--count K] [--market M]
  [--dry-run]` rents K VMs for RUN (tagged with it); with --dry-run it prints the exact API requests
  and the hourly cost and rents nothing.
- `cleanup [--provider aws|gcp] [--run RUN] [--dry-run]` removes (or lists) every instance,
  volume, security group or firewall tagged with the run (every sailor run if --run is omitted);
  without --provider it covers each cloud that is configured.
Settings come from the environment (infra.registry.provider_from_env); credentials only from the
SDKs' standard chains. Errors print one line with a fix.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from sailor_cli.options import (
    DryRun,
    GpuTypes,
    Json,
    Markets,
    Provider,
    ProviderOrNone,
    Regions,
    Run,
    RunOrNone,
    Store,
    Workdir,
    open_store,
    split_values,
)
from sailor_core.errors import CloudUnreachable, SailorError

app = typer.Typer(help="Cloud providers: offerings, catalogs, dry-run provisioning, cleanup.", no_args_is_help=True)


def _provider(name: str, regions: list[str] | None):
    from infra.registry import provider_from_env
    from sailor_core.errors import ProviderError

    try:
        return provider_from_env(name, env=os.environ, regions=regions or None)
    except ProviderError as e:
        raise SailorError(str(e)) from None


_NO_CREDENTIALS = {
    "NoCredentialsError": "no AWS credentials found; to fix: set AWS_PROFILE, run `aws sso login`, or run on a "
                          "VM with an instance role",
    "DefaultCredentialsError": "no Google credentials found; to fix: run `gcloud auth application-default login` "
                               "or set GOOGLE_APPLICATION_CREDENTIALS to a service account key file",
}


# Exception classes (by name, anywhere in the MRO, so no SDK is imported here) that mean the cloud's
# API could not be reached: botocore, google-api-core / google-auth, requests, urllib3.
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                "ServiceUnavailable", "DeadlineExceeded", "RetryError", "TransportError", "ConnectionError",
                "Timeout", "NewConnectionError", "MaxRetryError")
# An answer that is not the API's (a proxy's error page, a broken feed): botocore / JSON parsers.
_GARBLED = ("ResponseParserError", "JSONDecodeError", "ParseError", "DecodeError")
# An answer from the cloud that refused the call (credentials, permissions, bad request).
_REFUSED = ("ClientError", "GoogleAPICallError", "RefreshError")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _call(fn, *args, **kw):
    from sailor_core.errors import ProviderError

    try:
        return fn(*args, **kw)
    except ProviderError as e:
        raise SailorError(str(e)) from None
    except Exception as e:
        names = {c.__name__ for c in type(e).__mro__}
        if type(e).__name__ in _NO_CREDENTIALS:
            raise SailorError(_NO_CREDENTIALS[type(e).__name__]) from None
        if names & set(_UNREACHABLE) or isinstance(e, OSError | TimeoutError):
            raise CloudUnreachable(f"cannot reach the cloud's API ({type(e).__name__}: {_one_line(e)}); to fix: "
                                   f"check the network and the endpoint/region settings (SAILOR_AWS_ENDPOINT_URL, "
                                   f"SAILOR_GCE_ENDPOINT, regions), then retry") from None
        if names & set(_GARBLED):
            raise CloudUnreachable(f"the cloud's API answered with something unreadable ({type(e).__name__}: "
                                   f"{_one_line(e)[:160]}); to fix: check the endpoint settings "
                                   f"(SAILOR_AWS_ENDPOINT_URL, SAILOR_GCE_ENDPOINT) and any proxy in between, "
                                   f"then retry") from None
        if names & set(_REFUSED):
            raise SailorError(f"the cloud refused the request ({type(e).__name__}: {_one_line(e)}); to fix: check "
                              f"the credentials, their permissions and the request's settings") from None
        raise


@app.command("offerings")
def offerings(
    provider: Provider,
    region: Regions = None,
    gpu_type: GpuTypes = None,
    market: Markets = None,
    as_json: Json = False,
) -> None:
    """What can be rented now, per zone and market, with prices and their fetch time.

    Without --region: the configured regions.
    """
    from sailor_core.domain import Market

    regions, gpu_types, markets = split_values(region), split_values(gpu_type), split_values(market)
    p = _provider(provider, list(regions))
    offers = _call(p.offerings, regions=list(regions) or None, gpu_types=list(gpu_types) or None,
                   markets=[Market.parse(m) for m in markets] or None)
    if as_json:
        # `count` and `gpus_per_node`: what this output called `gpus` and `gpus_per_vm` before the one
        # capacity type, kept so that scripts reading them go on working
        rows = [{**asdict(o), "count": o.gpus, "gpus_per_node": o.gpus_per_vm} for o in offers]
        typer.echo(json.dumps(rows, indent=2, default=str))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{len(offers)} offering(s) on {provider}")
    for c in ("zone", "instance type", "GPU", "per VM", "market", "GPUs", "USD/GPU-h", "fetched (UTC)"):
        t.add_column(c)
    for o in sorted(offers, key=lambda o: (o.usd_per_gpu_hour, o.zone)):
        t.add_row(o.zone, o.instance_type, o.gpu_type, str(o.gpus_per_vm), o.market.value, str(o.gpus),
                  f"{o.usd_per_gpu_hour:.4f}", str(o.price_fetched_at or "")[:19])
    Console().print(t)


@app.command("catalog")
def catalog(
    path: Annotated[str, typer.Argument(help="a SkyPilot-format vms.csv")],
    cloud: Annotated[str, typer.Option("--cloud", help="whose catalog it is: aws or gcp")],
    as_json: Json = False,
) -> None:
    """Import a SkyPilot-format catalog: what was kept, and each rejected row with its reason."""
    from infra.catalog import load_skypilot_file

    table = load_skypilot_file(path, cloud=cloud)
    if as_json:
        typer.echo(json.dumps({"kept": len(table.rows), "rejected": [
            {"line": r.line, "reason": r.reason} for r in table.rejected]}, indent=2))
        return
    typer.echo(table.report())


@app.command("provision")
def provision(
    provider: Provider,
    run: Run,
    zone: Annotated[str, typer.Option("--zone", help="the zone to rent in, such as us-east-1a or us-central1-a")],
    gpu_type: Annotated[str, typer.Option("--gpu-type", help="the GPU type to rent, such as A10G-24 or V100-16")],
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs per VM")] = 1,
    count: Annotated[int, typer.Option("--count", min=1, help="number of VMs")] = 1,
    market: Annotated[str, typer.Option("--market", help="the market to rent in: spot or on-demand")] = "spot",
    dry_run: DryRun = False,
) -> None:
    """Rent VMs for a run, each tagged with the run's id.

    With --dry-run: show exactly what would be sent and what it costs; rent nothing.
    """
    from infra.cloud import format_dry_run
    from infra.provider import VmRequest
    from sailor_core.domain import Market, default_region

    p = _provider(provider, [default_region(zone)])
    reqs = [VmRequest(run_id=run, name=f"w{i}", zone=zone, gpu_type=gpu_type, gpus=gpus, market=Market.parse(market))
            for i in range(count)]
    vms = _call(p.provision, reqs, dry_run=dry_run)
    if dry_run:
        typer.echo(format_dry_run(p.last_dry_run))
        return
    for v in vms:
        typer.echo(f"{v.vm_id} {v.zone} {v.gpus}x {v.gpu_type} {v.market.value} {v.address} ${v.usd_per_hour:.4f}/h")
    for f in getattr(p, "fallbacks", []):
        typer.echo(f"capacity fallback: {f.name} {f.requested_zone} -> {f.zone} ({f.reason})")
    typer.echo(f"hourly cost: ${sum(v.usd_per_hour for v in vms):.4f}/h; remove with: sailor infra cleanup "
               f"--provider {provider} --run {run}")


def _configured(name: str) -> bool:
    env = os.environ
    if name == "gcp":
        return bool(env.get("SAILOR_GCP_PROJECT") or env.get("GOOGLE_CLOUD_PROJECT"))
    from infra.aws import credentials_available

    return credentials_available()


@app.command("cleanup")
def cleanup(
    provider: ProviderOrNone = None,
    run: RunOrNone = None,
    region: Regions = None,
    dry_run: DryRun = False,
    workdir: Workdir = Path(".sailor"),
    store: Store = None,
) -> None:
    """Find and remove every resource a run (or every run) left: VMs, disks, security groups, firewalls.

    Without --provider: every configured cloud; without --run: every sailor run; without --region: the
    configured regions. --dry-run lists what would be removed.

    `--provider local` removes local testbeds whose owner process is dead (namespaces, veths,
    bridges, cgroups, VM folders and their processes; infra/testbed.py), and the VMs (worker
    processes) of every run in the store whose flow died (lease expired: written down as crashed);
    `--run` does not apply; `--workdir` and `--store` are those of the local runs."""
    if provider == "local":
        _cleanup_crashed_local(workdir, store, dry_run)
        _cleanup_local(dry_run)
        return
    names = [provider] if provider else [n for n in ("aws", "gcp") if _configured(n)]
    verb = "would remove" if dry_run else "removed"
    total = 0
    for name in names:
        p = _provider(name, list(split_values(region)))
        removed = _call(p.cleanup_resources, run, dry_run=dry_run)
        for r in removed:
            typer.echo(f"{name}: {verb} {r}")
        total += len(removed)
        if not removed:
            typer.echo(f"{name}: nothing left by {'run ' + run if run else 'any sailor run'}")
    typer.echo(f"{verb} {total} resource(s)")


def _cleanup_crashed_local(workdir: Path, store: str | None, dry_run: bool) -> None:
    """Runs whose lease expired: mark them crashed and stop the worker processes they left."""
    from infra.local import LocalProvider
    from tasks.history import RunEvent, RunHistory

    history = RunHistory(open_store(store))
    for r in history.list_runs():
        if not r.get("crash_detected"):
            continue
        root = workdir.resolve() / "runs" / r["run_id"] / "local"
        if dry_run:
            typer.echo(f"local: would mark run {r['run_id']} crashed ({r.get('status_reason', '')}) and remove "
                       f"what it left under {root}")
            continue
        history.mark_crashed(r["run_id"], str(r.get("status_reason", "lease expired")))
        removed = LocalProvider(root).cleanup(r["run_id"]) if root.is_dir() else []
        history.event(r["run_id"], RunEvent.TEARDOWN, f"sailor infra cleanup found this run crashed and removed "
                      f"{len(removed)} VM(s) it left", {"removed": list(removed)})
        typer.echo(f"local: run {r['run_id']} crashed ({r.get('status_reason', '')}); removed {len(removed)} VM(s)")


def _cleanup_local(dry_run: bool) -> None:
    from infra.testbed import cleanup_stale, default_home, stale_testbeds

    if dry_run:
        found = stale_testbeds()
        for tag in found:
            typer.echo(f"local: would remove testbed {tag} (under {default_home()})")
        typer.echo(f"would remove {len(found)} testbed(s)")
        return
    removed = cleanup_stale()
    for r in removed:
        typer.echo(f"local: removed {r}")
    typer.echo(f"removed {len(removed)} resource(s)")
