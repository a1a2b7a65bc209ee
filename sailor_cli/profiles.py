"""`sailor profiles`: list, show, import and export what the profile store holds.

Contract: every command takes `--store URI` (a folder, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX;
default $SAILOR_STORE, else ./.sailor/store) and opens it over the shipped seed. `list` and `show`
print a rich table, or JSON with `--json` (a list of objects with at least `model` and
`gpu_type` for `list`). Store errors are `SailorError`s: sailor_cli.main prints them in one line
and exits 2.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer

from sailor_cli.options import Json, Store, open_store
from sailor_core.errors import SailorError

app = typer.Typer(
    help="The profile store: list, show, import and export profiles, network links and prices.",
    no_args_is_help=True,
)

def _fmt_ints(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def _span(values: tuple[int, ...]) -> str:
    """1,2,4,8 stays; a long list becomes 'first..last (n)'."""
    return _fmt_ints(values) if len(values) <= 4 else f"{values[0]}..{values[-1]} ({len(values)})"


@app.command("list")
def list_pairs(store: Store = None, as_json: Json = False) -> None:
    """Every (model, GPU type) with layer profiles, the microbatch sizes and TP degrees profiled, and the source."""
    s = open_store(store)
    pairs = s.list_pairs()
    if as_json:
        typer.echo(json.dumps([p.to_json() for p in pairs], indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Layer profiles in {s.uri}" + (" over the shipped seed" if s.seed else ""))
    for col in ("model", "GPU type", "layers", "points", "mbs", "tp", "from"):
        table.add_column(col, justify="right" if col in ("layers", "points") else "left", no_wrap=col != "from")
    for p in pairs:
        points = p.rows // p.layers if p.layers else 0
        origin = p.host.rsplit("/", 1)[-1] if p.host else p.source
        table.add_row(p.model, p.gpu_type, str(p.layers), str(points), _span(p.mbs), _fmt_ints(p.tp), origin)
    table.caption = "source: " + "; ".join(sorted({p.source for p in pairs}))
    Console().print(table)
    typer.echo(f"{len(pairs)} (model, GPU type) pairs")


@app.command("show")
def show(
    model: Annotated[str, typer.Argument(help="Model name, e.g. OPT-350.")],
    gpu_type: Annotated[str, typer.Argument(help="GPU type, e.g. A100-40.")],
    store: Store = None,
    as_json: Json = False,
    layers: Annotated[bool, typer.Option("--layers", help="List every layer's times, not only the sums.")] = False,
) -> None:
    """The profile of one (model, GPU type): per (mbs, tp), the summed forward/backward time and the optimizer step."""
    s = open_store(store)
    spec = s.model(model)
    s.require_gpu_types([gpu_type])
    rows = s.read_table("layer_profiles", {"model": model, "gpu_type": gpu_type}).to_pylist()
    if not rows:
        have = sorted(p["gpu_type"] for p in s.partitions("layer_profiles") if p["model"] == model)
        raise SailorError(
            f"the store has no layer profiles for ({model}, {gpu_type}); it has {model} on {have}; to fix: profile it "
            f"(sailor profile model --model {model} on a {gpu_type} machine) or pick one of those GPU types"
        )
    points: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        points.setdefault((r["mbs"], r["tp"]), []).append(r)
    newest = max(rows, key=lambda r: r["recorded_at"])
    summary = [
        {
            "mbs": m,
            "tp": t,
            "layers": len(rs),
            "forward_s": sum(r["forward_s"] for r in rs),
            "backward_s": sum(r["backward_s"] for r in rs),
            "optimizer_s": max(r["optimizer_s"] for r in rs),
            **({"per_layer": [[r["layer"], r["forward_s"], r["backward_s"], r["optimizer_s"]] for r in rs]}
               if layers else {}),
        }
        for (m, t), rs in sorted(points.items())
    ]
    if as_json:
        doc = {"model": model, "gpu_type": gpu_type, "num_layers": spec.num_layers, "points": summary,
               "source": newest["source"], "host": newest["host"], "recorded_at": newest["recorded_at"].isoformat()}
        typer.echo(json.dumps(doc, indent=1))
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    title = f"{model} on {gpu_type}: {spec.num_layers} layers; from {newest['source']} ({newest['host']})"
    table = Table(title=title)
    for col in ("mbs", "tp", "layers", "forward s (sum)", "backward s (sum)", "optimizer s"):
        table.add_column(col, justify="right")
    for p in summary:
        table.add_row(str(p["mbs"]), str(p["tp"]), str(p["layers"]), f"{p['forward_s']:.5f}",
                      f"{p['backward_s']:.5f}", f"{p['optimizer_s']:.5f}")
    con.print(table)
    if layers:
        for p in summary:
            lt = Table(title=f"mbs={p['mbs']} tp={p['tp']}")
            for col in ("layer", "forward s", "backward s", "optimizer s"):
                lt.add_column(col, justify="right")
            for layer, f, b, o in p["per_layer"]:
                lt.add_row(str(layer), f"{f:.6f}", f"{b:.6f}", f"{o:.6f}")
            con.print(lt)


@app.command("import-eth-easl")
def import_eth_easl(
    directory: Annotated[Path, typer.Argument(
        help="A folder laid out as eth-easl/sailor (or the folder holding eth-easl-sailor/).")],
    store: Store = None,
) -> None:
    """Import the Sailor artifact's published profiles, network fits, egress prices, GPU prices and quotas."""
    from profiles_store.eth_easl import read_eth_easl
    from profiles_store.importer import import_eth_easl as do_import

    data = read_eth_easl(directory)
    s = open_store(store)
    counts = do_import(s, data, recorded_at=datetime.now(UTC))
    typer.echo(f"imported into {s.uri}: " + ", ".join(f"{n} {t}" for t, n in counts.items()))


@app.command("export")
def export(
    out: Annotated[Path, typer.Option("--out", help="Folder to write one CSV per table into (created if missing).")],
    store: Store = None,
) -> None:
    """Write every table (the store's rows over the seed) as CSV, one file per table."""
    s = open_store(store)
    counts = s.export_csv(out)
    for table, n in counts.items():
        typer.echo(f"{out / (table + '.csv')}: {n} rows")
