"""`sailor profile`: measure a model's layers or the network on this machine and store the result.

Contract:
- `sailor profile model --model MODEL [--device cpu|cuda] [--mbs 1,2,4] [--tp 1,2] [--store URI]`
  (or `--model-config config.json`: a Hugging Face style Llama / GPT-NeoX / OPT config, stored
  under its name) measures the grid with sailor_core.profiler (the same code as the flow's
  profiling tasks), shows a progress bar and a per-layer summary table, then replaces the (model, GPU type) profile
  in the store in one commit. `--all-blocks` measures every block instead of a few.
- `sailor profile network [--workers 2] [--store URI]` measures point-to-point and all-reduce time
  between local workers, prints measured against fitted time per message size, and upserts the link.
- `--json` prints the result as JSON instead of tables. Nothing is written when the measurement
  fails or is interrupted (Ctrl-C). Bad input is a `SailorError`: one line, exit 2 (sailor_cli.main).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Annotated, Any

import typer

from sailor_cli.options import (
    Device,
    GpuTypeLabel,
    Json,
    MaxBytes,
    MaxBytesOrNone,
    Model,
    ModelConfig,
    SeqLen,
    Statistic,
    Store,
    TimeoutS,
    open_store,
)
from sailor_core.errors import SailorError

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

    t = Table(title=f"{profile.model} on {profile.gpu_type}: measured layers (10th percentile)")
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
    """
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
    a, b, c = profile.link.fit.coeffs
    worst = max(abs(e) for e in profile.p2p_errors())
    out.print(f"p2p fit: bw_GBps = {a:.4g}*u^2 + {b:.4g}*u + {c:.4g}, u = log2(bytes/1e6); max "
              f"{profile.link.fit.max_bytes_per_s / 1e9:.2f} GB/s; worst error {worst:.1%}")
    for what, ab in (("p2p", profile.p2p_alpha_beta), ("all-reduce", profile.allreduce_alpha_beta)):
        out.print(f"{what} alpha-beta: latency {ab.latency_s * 1e6:.1f} us, "
                  f"bandwidth {ab.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
    out.print(f"upserted link {profile.link.sender_zone}:{profile.link.sender_gpu}x1 -> "
              f"{profile.link.receiver_zone}:{profile.link.receiver_gpu}x1, intra-node {profile.intra_node.gpu_type}x2 "
              f"and the node's all-reduce over {profile.node_allreduce.workers} workers into {uri}")


def _zone_type(text: str, what: str) -> tuple[str, str]:
    zone, sep, gpu = text.partition(":")
    if not zone or not sep or not gpu:
        raise SailorError(f"{what} must be ZONE:TYPE like us-east:cpu-fast, got {text!r}")
    return zone, gpu


@app.command("link")
def link_cmd(
    rank: Annotated[int, typer.Option("--rank", help="0 on the sending VM, 1 on the receiving one")],
    src: Annotated[str, typer.Option("--from", help="ZONE:TYPE of rank 0's VM")],
    dst: Annotated[str, typer.Option("--to", help="ZONE:TYPE of rank 1's VM")],
    key: Annotated[str, typer.Option("--key", help="controller key the two ends meet under")],
    store: Store = None,
    max_bytes: MaxBytes = 4 * 1024 * 1024,
    timeout_s: TimeoutS = 600.0,
) -> None:
    """Measure the link between this VM and one other (run on both); rank 0 stores it both ways.

    --timeout: how long to wait for the other end.
    Run by the flow's profile subflow on rented VMs (the run's controller from $SAILOR_CONTROL and
    $SAILOR_RUN_SECRET, this VM's address from $SAILOR_ADVERTISE_ADDR).
    """
    import os
    from dataclasses import replace

    from sailor_core.profiler.network import LINK_POLICY, NetworkSettings, measure_link
    from sailor_core.runtime.protocol import client_from_env

    if rank not in (0, 1):
        raise SailorError(f"--rank must be 0 or 1, got {rank}")
    ends = (_zone_type(src, "--from"), _zone_type(dst, "--to"))
    settings = NetworkSettings(workers=2, device="cpu", max_bytes=max_bytes, timeout_s=timeout_s, allreduce=False,
                               policy=LINK_POLICY)
    settings.validate()
    st = open_store(store) if rank == 0 else None
    prof = measure_link(settings, rank=rank, rendezvous=client_from_env(), key=key,
                        advertise_addr=os.environ.get("SAILOR_ADVERTISE_ADDR", "127.0.0.1"), ends=ends)
    if prof is None or st is None:
        return
    back = replace(prof.link, sender_zone=prof.link.receiver_zone, sender_gpu=prof.link.receiver_gpu,
                   receiver_zone=prof.link.sender_zone, receiver_gpu=prof.link.sender_gpu)
    st.write_network_links([prof.link, back], provenance=prof.provenance)
    a, b, c = prof.link.fit.coeffs
    typer.echo(f"link {src} <-> {dst}: max {prof.link.fit.max_bytes_per_s / 1e6:.1f} MB/s "
               f"(fit {a:.4g}, {b:.4g}, {c:.4g})")
