"""`sailor profile`: measure a model's layers or the network on this machine and store the result.

Contract:
- `sailor profile model --model MODEL [--device cpu|cuda] [--mbs 1,2,4] [--tp 1,2] [--store URI]`
  (or `--model-config config.json`: a Hugging Face style Llama / GPT-NeoX / OPT config, stored
  under its name) measures the grid with sailor_core.profiler (the same code as the flow's
  profiling tasks), shows a progress bar and a per-layer summary table, then replaces the (model, GPU type) profile
  in the store in one commit. `--all-blocks` measures every block instead of a few.
- `sailor profile network [--workers 2] [--store URI]` measures point-to-point and all-reduce time
  between local workers, prints measured against fitted time per message size, and upserts the link.
  With `--from ZONE[:TYPE] --to ZONE[:TYPE] [--provider local|aws|gcp] [--scenario FILE]` it rents a VM
  at each end instead, measures the link between them (flows/profiling.measure_zone_link, the profile
  subflow's code), upserts it in the format `sailor plan` reads, and releases the VMs, also on failure.
- `--json` prints the result as JSON instead of tables. Nothing is written when the measurement
  fails or is interrupted (Ctrl-C). Bad input is a `SailorError`: one line, exit 2 (sailor_cli.main).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from sailor_cli.options import (
    Device,
    GpuTypeLabel,
    Isolation,
    Json,
    LinkFrom,
    LinkTo,
    MaxBytes,
    MaxBytesOrNone,
    Model,
    ModelConfig,
    ScenarioOrNone,
    SeqLen,
    Statistic,
    Store,
    TimeoutS,
    Workdir,
    open_store,
)
from sailor_core.errors import SailorError
from tasks import interrupt

app = typer.Typer(help="Measure a model's layers or the network on this machine and store the profile.",
                  no_args_is_help=True)

def _int_list(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SailorError(f"{what} must be comma-separated integers like 1,2,4, got {text!r}") from None
    if not values:
        raise SailorError(f"{what} is empty; to fix: e.g. {what} 1,2")
    return values


@contextlib.contextmanager
def _progress_bar(description: str, total: int, *, transient: bool) -> Iterator[tuple[Any, Any, Any]]:
    """A progress bar on stderr: (bar, its task, the stderr console); `transient` clears it at the end."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=transient) as bar:
        yield bar, bar.add_task(description, total=total), console


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.command("model")
def model_cmd(
    model: Model = None,
    model_config: ModelConfig = None,
    seq_len: SeqLen = None,
    device: Device = "cpu",
    mbs: Annotated[str, typer.Option("--mbs", help="microbatch sizes, comma-separated")] = "1,2,4",
    tp: Annotated[str, typer.Option("--tp", help="TP degrees, comma-separated (each <= GPUs of this node)")] = "1",
    store: Store = None,
    gpu_type: GpuTypeLabel = None,
    all_blocks: Annotated[bool, typer.Option(
        "--all-blocks", help="measure every block, not a few copied to the rest")] = False,
    precision: Annotated[str, typer.Option("--precision", help="fp32, or bf16 (autocast, as bf16 plans run)")] = "fp32",
    statistic: Statistic = "mean",
    as_json: Json = False,
) -> None:
    """Profile per-layer forward/backward/optimizer time and activation memory; replace it in the store."""
    from sailor_core.models.hf_config import resolve_model
    from sailor_core.profiler import ModelProfileSettings, profile_model, save_model_profile

    model_cfg = resolve_model(model, model_config, seq_len)
    settings = ModelProfileSettings(
        model=model_cfg.name, model_config=model_cfg if model_config else None, device=device,
        mbs=_int_list(mbs, "--mbs"), tp=_int_list(tp, "--tp"),
        gpu_type=gpu_type, all_blocks=all_blocks, precision=precision, statistic=statistic,
    )
    cfg = settings.validate()  # bad input fails before the store is opened or a worker starts
    st = open_store(store)
    per_point = len(settings.measured_layers(cfg))
    total = len(settings.mbs) * len(settings.tp) * per_point
    with _progress_bar(f"profiling {cfg.name} on {device}", total, transient=as_json) as (bar, task, console):
        advanced: dict[tuple[int, int], int] = {}

        def progress(msg: dict) -> None:
            if msg["kind"] == "layer":
                key = (msg["mbs"], msg["tp"])
                advanced[key] = advanced.get(key, 0) + 1
                bar.update(task, advance=1,
                           description=f"{cfg.name} mbs={msg['mbs']} tp={msg['tp']} layer {msg['layer']}")
            elif msg["kind"] == "infeasible":
                key = (msg["mbs"], msg["tp"])
                bar.update(task, advance=per_point - advanced.get(key, 0))
                advanced[key] = per_point
                console.print(f"[yellow]infeasible: mbs={msg['mbs']} tp={msg['tp']}: {msg['reason']}")

        profile = profile_model(settings, progress)
    # A Ctrl-C that came while the measurement ended (its workers gone, the bar closing) is still a stop:
    # nothing is written. The store's commit is the only step after this point.
    interrupt.check()
    rows = save_model_profile(st, profile)

    if as_json:
        typer.echo(json.dumps(_model_json(profile, rows, st.uri), indent=1))
        return
    _print_model(profile, rows, st.uri)


def _model_json(profile, rows: int, uri: str) -> dict:
    return {
        "model": profile.model,
        "gpu_type": profile.gpu_type,
        "store": uri,
        "rows_written": rows,
        "framework_overhead_bytes": profile.framework_overhead_bytes,
        "optimizer_s": {str(k): v for k, v in profile.optimizer_s.items()},
        "infeasible": [{"mbs": x.mbs, "tp": x.tp, "reason": x.reason} for x in profile.infeasible],
        "layers": [
            {"mbs": p.mbs, "tp": p.tp, "layer": p.layer, "forward_s": p.forward_s, "backward_s": p.backward_s,
             "optimizer_s": p.optimizer_s}
            for p in profile.profiles
        ],
        "measured": [
            {"mbs": p.mbs, "tp": p.tp, "layer": p.layer, "forward_s": p.forward_s, "backward_s": p.backward_s,
             "reps": p.forward.reps, "saved_bytes": p.saved_bytes, "allocated_bytes": p.allocated_bytes}
            for p in profile.points
        ],
    }


def _print_model(profile, rows: int, uri: str) -> None:
    from rich.console import Console
    from rich.table import Table

    stat = profile.points[0].statistic if profile.points else "mean"
    t = Table(title=f"{profile.model} on {profile.gpu_type}: measured layers ({stat} of the repetitions)")
    for c in ("mbs", "tp", "layer", "forward ms", "backward ms", "reps", "kept for backward", "spec", "diff"):
        t.add_column(c, justify="right")
    for p in profile.points:
        spec = profile.spec.layer(p.layer, p.tp).act_memory_bytes * p.mbs
        diff = (p.saved_bytes - spec) / spec if spec else 0.0
        t.add_row(str(p.mbs), str(p.tp), str(p.layer), f"{p.forward_s * 1e3:.3f}", f"{p.backward_s * 1e3:.3f}",
                  str(p.forward.reps), _fmt_bytes(p.saved_bytes), _fmt_bytes(spec), f"{diff:+.1%}")
    console = Console()
    console.print(t)
    for tp, s in sorted(profile.optimizer_s.items()):
        console.print(f"optimizer step (whole model, one GPU of tp={tp}): {s * 1e3:.3f} ms")
    console.print(f"framework overhead on {profile.gpu_type}: {_fmt_bytes(profile.framework_overhead_bytes)}")
    for x in profile.infeasible:
        console.print(f"[yellow]infeasible: mbs={x.mbs} tp={x.tp}: {x.reason}")
    console.print(f"wrote {rows} layer-profile rows for ({profile.model}, {profile.gpu_type}) to {uri}")


@app.command("network")
def network_cmd(
    src: LinkFrom = None,
    dst: LinkTo = None,
    provider: Annotated[str, typer.Option("--provider", help="with --from/--to: local, aws or gcp")] = "local",
    scenario: ScenarioOrNone = None,
    isolation: Isolation = "auto",
    workdir: Workdir = Path(".sailor"),
    workers: Annotated[int, typer.Option("--workers", help="local worker processes (one GPU each on CUDA)")] = 2,
    store: Store = None,
    device: Device = "cpu",
    min_bytes: Annotated[int, typer.Option("--min-bytes", help="smallest message, in bytes")] = 64 * 1024,
    max_bytes: MaxBytesOrNone = None,
    zone: Annotated[str, typer.Option("--zone", help="zone label of both ends")] = "local",
    gpu_type: GpuTypeLabel = None,
    statistic: Statistic = "p20",
    as_json: Json = False,
) -> None:
    """Measure point-to-point and all-reduce time between local workers, fit, and upsert the link.

    The largest message is --max-bytes, else 64 MiB on CPU (gloo) and 1 GiB on CUDA (nccl).
    With --from ZONE[:TYPE] --to ZONE[:TYPE]: rent a VM at each end from --provider (the local testbed of
    --scenario, as root for isolated VMs), measure the link between them both ways, store it for every
    device type of the two zones (the named one at an end that names one) and release the VMs.
    """
    if src is not None or dst is not None:
        _zone_link(src, dst, provider=provider, scenario=scenario, isolation=isolation, workdir=workdir, store=store,
                   as_json=as_json)
        return
    from sailor_core.profiler import NetworkSettings, profile_network, save_network_profile
    from sailor_core.profiler.network import to_json

    settings = NetworkSettings(workers=workers, device=device, min_bytes=min_bytes, max_bytes=max_bytes,
                               zone=zone, gpu_type=gpu_type, statistic=statistic)
    settings.validate()
    st = open_store(store)
    title = f"network between {workers} workers"
    with _progress_bar(title, len(settings.sizes()), transient=as_json) as (bar, task, _):

        def progress(msg: dict) -> None:
            bar.update(task, completed=msg["done"], description=f"{_fmt_bytes(msg['bytes'])} done")

        profile = profile_network(settings, progress)
    save_network_profile(st, profile)
    if as_json:
        typer.echo(to_json(profile))
        return
    _print_network(profile, workers, st.uri)


def _print_network(profile: Any, workers: int, uri: str) -> None:
    from rich.console import Console
    from rich.table import Table

    from sailor_core.profiler.network import summary_rows

    t = Table(title=f"network {profile.link.sender_zone}/{profile.link.sender_gpu} x{workers} workers "
                    f"(fastest repetition per size)")
    for c in ("bytes", "p2p ms", "fit ms", "err", "all-reduce ms", "fit ms", "err", "ring from p2p ms"):
        t.add_column(c, justify="right")
    for r in summary_rows(profile):
        t.add_row(_fmt_bytes(r["bytes"]), f"{r['p2p_measured_s'] * 1e3:.3f}", f"{r['p2p_predicted_s'] * 1e3:.3f}",
                  f"{r['p2p_err']:+.1%}", f"{r['allreduce_measured_s'] * 1e3:.3f}",
                  f"{r['allreduce_predicted_s'] * 1e3:.3f}",
                  f"{r['allreduce_err']:+.1%}", f"{r['allreduce_ring_s'] * 1e3:.3f}")
    out = Console()
    out.print(t)
    worst = max(abs(e) for e in profile.p2p_errors())
    out.print(f"p2p fit: {profile.link.fit.describe()}; worst error {worst:.1%}")
    for what, ab in (("p2p", profile.p2p_alpha_beta), ("all-reduce", profile.allreduce_alpha_beta)):
        out.print(f"{what} alpha-beta: latency {ab.latency_s * 1e6:.1f} us, "
                  f"bandwidth {ab.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    out.print(f"upserted link {profile.link.sender_zone}:{profile.link.sender_gpu}x1 -> "
              f"{profile.link.receiver_zone}:{profile.link.receiver_gpu}x1, intra-node {profile.intra_node.gpu_type}x2 "
              f"and the node's all-reduce over {profile.node_allreduce.workers} workers into {uri}")


def _zone_link(src: str | None, dst: str | None, *, provider: str, scenario: Path | None, isolation: str,
               workdir: Path, store: str | None, as_json: bool) -> None:
    """`profile network --from/--to`: flows/profiling.measure_zone_link, then what it measured."""
    from flows.params import validate_params
    from flows.profiling import measure_zone_link
    from flows.sailor import default_deps
    from tasks.history import new_run_id

    if src is None or dst is None:
        raise SailorError("--from and --to go together; to fix: name both ends, e.g. --from eu-west --to us-east")
    ends = (_zone_and_type(src, "--from"), _zone_and_type(dst, "--to"))
    if provider not in ("local", "aws", "gcp"):
        raise SailorError(f"--provider must be local, aws or gcp, got {provider!r}")
    if scenario is not None and provider != "local":
        raise SailorError("--scenario is for the local provider; to fix: drop it, or use --provider local")
    st = open_store(store)  # checks the URI before anything is rented
    params = validate_params({"run_name": "profile-network", "provider": provider, "steps": 1,
                              "scenario": None if scenario is None else str(scenario),
                              "store_uri": st.uri, "workdir": str(workdir), "isolation": isolation})
    run_id = new_run_id("profile-network")
    out = measure_zone_link(params, ends[0], ends[1], _Say(), deps=default_deps(params, run_id), run_id=run_id)
    fit = out.link.fit
    if as_json:
        typer.echo(json.dumps({"run_id": out.run_id, "vms": out.vms, "store": out.store, "rows": out.rows,
                               "fit_coeffs": list(fit.coeffs), "max_bytes_per_s": fit.max_bytes_per_s,
                               "bytes_per_s": {str(n): fit.bandwidth_bytes_per_s(n) for n in _SIZES}}, indent=1))
        return
    at = ", ".join(f"{_fmt_bytes(n)} {fit.bandwidth_bytes_per_s(n) / 1e6:.1f} MB/s" for n in _SIZES)
    typer.echo(f"link {src} <-> {dst} measured between {out.vms[0]} and {out.vms[1]} (released): {at}")
    typer.echo(f"wrote {len(out.rows) * 2} link rows ({'; '.join(out.rows)}, both ways) into {out.store}")


class _Say:
    """The log `measure_zone_link` writes to: its lines on stderr, as they come."""

    def info(self, msg: str, *args: object) -> None:
        typer.echo(msg % args if args else msg, err=True)


_SIZES = (64 * 1024, 1024 * 1024, 16 * 1024 * 1024)  # message sizes the by-hand link's summary shows


def _zone_and_type(text: str, what: str) -> tuple[str, str | None]:
    zone, _, gpu = text.partition(":")
    if not zone:
        raise SailorError(f"{what} must be ZONE or ZONE:TYPE like eu-west:cpu-fast, got {text!r}")
    return zone, gpu or None


def _zone_type(text: str, what: str) -> tuple[str, str]:
    zone, sep, gpu = text.partition(":")
    if not zone or not sep or not gpu:
        raise SailorError(f"{what} must be ZONE:TYPE like us-east:cpu-fast, got {text!r}")
    return zone, gpu


@app.command("link")
def link_cmd(
    rank: Annotated[int, typer.Option("--rank", help="0 on the sending VM, 1 on the receiving one")],
    key: Annotated[str, typer.Option("--key", help="controller key the two ends meet under")],
    src: LinkFrom = None,
    dst: LinkTo = None,
    store: Store = None,
    max_bytes: MaxBytes = 4 * 1024 * 1024,
    timeout_s: TimeoutS = 600.0,
) -> None:
    """Measure the link between this VM and one other (run on both); rank 0 stores it both ways, and the
    all-reduce of the two over it (what a data-parallel ring step across the link costs).

    --timeout: how long to wait for the other end.
    Run by the flow's profile subflow on rented VMs (the run's controller from $SAILOR_CONTROL and
    $SAILOR_RUN_SECRET, this VM's address from $SAILOR_ADVERTISE_ADDR).
    """
    import os
    from dataclasses import replace

    from profiles_store.tables import LINK_ALLREDUCE, NETWORK_LINKS
    from sailor_core.domain import LinkAllReduce
    from sailor_core.profiler.network import LINK_POLICY, NetworkSettings, measure_link
    from sailor_core.runtime.protocol import client_from_env

    if rank not in (0, 1):
        raise SailorError(f"--rank must be 0 or 1, got {rank}")
    ends = (_zone_type(src or "", "--from"), _zone_type(dst or "", "--to"))
    settings = NetworkSettings(workers=2, device="cpu", max_bytes=max_bytes, timeout_s=timeout_s, allreduce=True,
                               policy=LINK_POLICY)
    settings.validate()
    st = open_store(store) if rank == 0 else None
    prof = measure_link(settings, rank=rank, rendezvous=client_from_env(), key=key,
                        advertise_addr=os.environ.get("SAILOR_ADVERTISE_ADDR", "127.0.0.1"), ends=ends)
    if prof is None or st is None:
        return
    lk = prof.link
    back = replace(lk, sender_zone=lk.receiver_zone, sender_gpu=lk.receiver_gpu,
                   receiver_zone=lk.sender_zone, receiver_gpu=lk.sender_gpu)
    st.write(NETWORK_LINKS, [lk, back], provenance=prof.provenance)
    ar = LinkAllReduce(zone_a=lk.sender_zone, gpu_a=lk.sender_gpu, zone_b=lk.receiver_zone, gpu_b=lk.receiver_gpu,
                       fit=prof.allreduce_fit)
    st.write(LINK_ALLREDUCE, [ar, replace(ar, zone_a=ar.zone_b, gpu_a=ar.gpu_b, zone_b=ar.zone_a, gpu_b=ar.gpu_a)],
                            provenance=prof.provenance)
    typer.echo(f"link {src} <-> {dst}: {lk.fit.describe()}")
    typer.echo(f"all-reduce over it (2 workers): {ar.fit.describe()}")
