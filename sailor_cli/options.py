"""Options and helpers that several `sailor` commands share.

Contract: an option that more than one command takes is defined here once, as an `Annotated` alias
(flag, type, one help text), and every command declares its options in that one style:
`store: Store = None`, `as_json: Json = False`; a required option has no default (`provider:
Provider`). A command's own default or detail for a shared option goes into its docstring, never
into a second help text (tests/test_cli_options.py checks that each shared flag reads the same in
every command). Where one option serves as a required single value in one command and an optional
one in another, the two aliases share one `typer.Option` (hence one help text).

A flag name that means different things in different commands keeps its own definition in its
command: `--out` (a plan file, a CSV folder, a shard prefix), `--recompute` (stages to recompute in
`simulate`, a switch in `train`), `--workers` (the most devices a demo plan may use, the processes
`profile network` starts), `--zone`, `--gpu-type` and `--market` of `infra provision` (the one place
to rent in, not filters), `--zone` of `profile network` (a label of both ends), `--cloud` of
`infra catalog` (whose catalog it is).

Helpers: `open_store` (the store a `--store` names, imported lazily), `load_book` and
`load_model_book` (a model's ProfileBook: the store, else the published reference data),
`split_values` (repeatable, comma-separable filters).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from sailor_core import files
from sailor_core.errors import SailorError
from sailor_core.planner.request import Objective as _Objective

if TYPE_CHECKING:
    from profiles_store.store import ProfileStore
    from sailor_core.profiles import ProfileBook

# --- where data comes from and how the answer is printed ---------------------------------------------------------
Store = Annotated[str | None, typer.Option(
    "--store", help="store URI: a folder, s3://BUCKET/PREFIX or gs://BUCKET/PREFIX (query: endpoint_override, "
                    "region, anonymous); default: $SAILOR_STORE, else .sailor/store")]
Json = Annotated[bool, typer.Option("--json", help="print JSON instead of text and tables")]
Workdir = Annotated[Path, typer.Option(
    "--workdir", help="working folder of local runs (checkpoints, worker metrics, VM folders)")]
PlanFormat = Annotated[str, typer.Option("--format", help="plan file format: sailor | eth-easl | auto")]

# --- the model and the job ---------------------------------------------------------------------------------------
Model = Annotated[str | None, typer.Option(
    "--model", help="model name, e.g. gpt-tiny or OPT-350 (with --model-config: the name it is stored under)")]
ModelConfig = Annotated[str | None, typer.Option(
    "--model-config", help="a Hugging Face style config.json (Llama, GPT-NeoX, OPT), path or s3:// / gs:// URI")]
SeqLen = Annotated[int | None, typer.Option(
    "--seq-len", help="training sequence length of a --model-config model (default: its max_position_embeddings)")]
_GLOBAL_BATCH = typer.Option("--global-batch-size", help="sequences per iteration (the global batch)")
GlobalBatchSize = Annotated[int, _GLOBAL_BATCH]
GlobalBatchSizeOrNone = Annotated[int | None, _GLOBAL_BATCH]
_STEPS = typer.Option("--steps", min=1, help="optimizer steps to train, in total (counting resumed ones)")
Steps = Annotated[int, _STEPS]
StepsOrNone = Annotated[int | None, _STEPS]

# --- what a plan optimises and may use -----------------------------------------------------------------------------
ObjectiveName = Annotated[str, typer.Option("--objective", help=" | ".join(o.value for o in _Objective))]
MaxUsdPerIteration = Annotated[float | None, typer.Option(
    "--max-usd-per-iteration", help="limit: USD per iteration")]
MaxUsdPerHour = Annotated[float | None, typer.Option("--max-usd-per-hour", help="limit: USD per hour")]
MinIterationsPerS = Annotated[float | None, typer.Option(
    "--min-iterations-per-s", help="limit: at least this many iterations per second")]
MaxGpus = Annotated[int | None, typer.Option("--max-gpus", help="use at most this many GPUs")]
MaxStages = Annotated[int | None, typer.Option(
    "--max-stages", help="most pipeline stages per plan (default: as many as pay)")]
CheckpointInterval = Annotated[int, typer.Option("--checkpoint-interval", min=0, help=(
    "steps between checkpoints (the work a preemption loses); 0, the default: automatic (docs/cli.md)"))]
ReconfigurationS = Annotated[float | None, typer.Option(
    "--reconfiguration-s", help="seconds from a preemption or a re-plan to training on the new plan "
                                "(default: the store's measured mean, else 15)")]

# --- filters: repeat the option or separate values with commas (split_values) ------------------------------------
Clouds = Annotated[list[str] | None, typer.Option("--cloud", help="only these clouds (repeat or comma-separate)")]
Regions = Annotated[list[str] | None, typer.Option("--region", help="only these regions (repeat or comma-separate)")]
Zones = Annotated[list[str] | None, typer.Option("--zone", help="only these zones (repeat or comma-separate)")]
GpuTypes = Annotated[list[str] | None, typer.Option(
    "--gpu-type", help="only these GPU types, e.g. A100-40 (repeat or comma-separate)")]
Markets = Annotated[list[str] | None, typer.Option(
    "--market", help="only these markets: spot, on-demand (repeat or comma-separate)")]

# --- clouds and runs (sailor infra, sailor replay) -----------------------------------------------------------------
_PROVIDER = typer.Option("--provider", help="aws or gcp (cleanup also takes local)")
Provider = Annotated[str, _PROVIDER]
ProviderOrNone = Annotated[str | None, _PROVIDER]
_RUN = typer.Option("--run", help="run id: the tag on a run's resources, as `sailor runs list` shows it")
Run = Annotated[str, _RUN]
RunOrNone = Annotated[str | None, _RUN]
DryRun = Annotated[bool, typer.Option("--dry-run", help="print what would be done; do nothing")]
# the local provider's testbed (sailor demo, sailor profile network --from/--to)
_SCENARIO = typer.Option("--scenario", help="scenario file of the local testbed: zones, device types, links, events")
Scenario = Annotated[Path, _SCENARIO]
ScenarioOrNone = Annotated[Path | None, _SCENARIO]
Isolation = Annotated[str, typer.Option("--isolation", help=(
    "VMs as isolated testbed VMs (netns, needs root), plain processes (process), or netns where permitted (auto)"))]

# --- measuring on this machine (sailor profile) ------------------------------------------------------------------
Device = Annotated[str, typer.Option("--device", help="cpu or cuda")]
GpuTypeLabel = Annotated[str | None, typer.Option(
    "--gpu-type", help="the GPU type the results are stored under (default: from the device)")]
Statistic = Annotated[str, typer.Option(
    "--statistic", help="what repetitions are summarised by: mean, median or a percentile such as p20")]
_MAX_BYTES = typer.Option("--max-bytes", help="largest message, in bytes")
MaxBytes = Annotated[int, _MAX_BYTES]
MaxBytesOrNone = Annotated[int | None, _MAX_BYTES]
TimeoutS = Annotated[float, typer.Option("--timeout", help="seconds a silent peer is waited for")]
LinkFrom = Annotated[str | None, typer.Option(
    "--from", help="ZONE[:TYPE] of the link's first end (profile link: ZONE:TYPE of rank 0's VM)")]
LinkTo = Annotated[str | None, typer.Option(
    "--to", help="ZONE[:TYPE] of the link's other end (profile link: ZONE:TYPE of rank 1's VM)")]


def split_values(values: list[str] | None) -> tuple[str, ...]:
    """A repeatable filter's values: `--region a --region b,c` -> ('a', 'b', 'c')."""
    return tuple(x.strip() for v in values or [] for x in v.split(",") if x.strip())


def open_store(store: str | None) -> ProfileStore:
    """The store `--store` names (default: $SAILOR_STORE, else .sailor/store), over the shipped seed."""
    from profiles_store.store import open_store as _open

    return _open(store, env=os.environ)


# Where the artifact's published data lies when no store has the model: $SAILOR_REFERENCE_DATA,
# else ../shared/reference_data next to the repository (the project's layout).
REFERENCE_ENV = "SAILOR_REFERENCE_DATA"


def _is_eth_easl_dir(path: str | Path) -> bool:
    p = Path(path)
    return (p / "eth-easl-sailor" / "sailor" / "Planner").is_dir() or (p / "sailor" / "Planner").is_dir()


def _reference_root() -> Path | None:
    env = os.environ.get(REFERENCE_ENV)
    cands = [Path(env)] if env else []
    cands.append(Path(__file__).resolve().parents[2] / "shared" / "reference_data")
    return next((c for c in cands if _is_eth_easl_dir(c)), None)


def load_book(model: str, store: str | None) -> ProfileBook:
    """The ProfileBook of `model`: from `store` (a store URI or a folder of published data), else
    the default store, else the published reference data."""
    from profiles_store.eth_easl import read_eth_easl

    if store and _is_eth_easl_dir(store):
        return read_eth_easl(store).profile_book(model)
    store_error: SailorError | None = None
    try:
        return open_store(store).profile_book(model)
    except SailorError as e:
        if store:
            raise  # the user named this store: its error is the answer
        store_error = e  # e.g. the model has no profile (yet): that, not the fallback's miss, is the answer
    except Exception:  # noqa: BLE001 - an unreadable default store falls back to the published data
        if store:
            raise
    root = _reference_root()
    if root is None and store_error is not None:
        raise store_error
    if root is None:
        raise SailorError(
            f"no profiles for model {model}: the default store has none and the published data was not found; "
            f"to fix: pass --store URI, set ${REFERENCE_ENV}, or run `sailor profiles import-eth-easl`"
        )
    try:
        return read_eth_easl(root).profile_book(model)
    except SailorError:
        if store_error is not None:
            raise store_error from None  # the published data lacks it too: say what the store lacks
        raise


def load_model_book(model: str, store: str | None) -> ProfileBook:
    """`load_book`, refusing a book of another model (a store that maps names)."""
    book = load_book(model, store)
    if book.model.name != model:
        raise SailorError(f"the store returned profiles for {book.model.name}, not {model}; to fix: check --model")
    return book


# --- paths checked before anything starts (a typo found in a worker costs a start-up and shows late) ---------------
def local_path(uri: str | os.PathLike[str]) -> Path | None:
    """The local path a path-or-URI option names (`file://` included); None for a remote one (s3://, gs://)."""
    s = os.fspath(uri)
    if s.startswith("file://"):
        return Path(s.removeprefix("file://"))
    return None if "://" in s else Path(s)


def _existing_ancestor(p: Path) -> Path:
    q = p.absolute()
    while not q.exists() and q != q.parent:
        q = q.parent
    return q


def check_input_path(flag: str, uri: str | None) -> None:
    """A local file or folder the command reads must exist (a remote URI is the store's or the worker's to check)."""
    p = local_path(uri) if uri else None
    if p is not None and not p.exists():
        raise SailorError(f"{flag} {uri} does not exist; to fix: check the path, or name an existing file or folder "
                          f"(s3:// and gs:// URIs are read as they are)")


def check_folder(flag: str, uri: str | os.PathLike[str] | None) -> None:
    """A local folder the command writes into (created if missing) must not be a file, nor lie under one, nor be a
    symbolic link to nothing (it passed as missing and failed in the workers)."""
    p = local_path(uri) if uri is not None else None
    if p is None:
        return
    if p.is_symlink() and not p.exists():
        raise SailorError(f"{flag} {uri} is a symbolic link to {os.readlink(p)}, which does not exist; to fix: name "
                          f"a folder (it is created if missing), or create the link's target")
    if p.exists() and not p.is_dir():
        raise SailorError(f"{flag} {uri} is a file, not a folder; to fix: name a folder (it is created if missing)")
    base = _existing_ancestor(p)
    if not base.is_dir():
        raise SailorError(f"{flag} {uri} cannot be created: {base} is a file; to fix: name a folder elsewhere")
    if not os.access(base, os.W_OK | os.X_OK):
        raise SailorError(f"{flag} {uri}: {base} is not writable; to fix: name a folder you may write to")


def check_output_file(flag: str, path: str | os.PathLike[str] | None) -> None:
    """A local file the command writes must be a regular file or a new path in an existing folder: never a folder,
    a device, a FIFO or a symbolic link (sailor_core/files.py)."""
    p = local_path(path) if path is not None else None
    if p is None:
        return
    if p.is_dir() and not p.is_symlink():
        raise SailorError(f"{flag} {path} is a folder, not a file; to fix: name a file (e.g. {p / 'metrics.jsonl'})")
    files.check_output_file(flag, p)
    if not os.access(p.absolute().parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise SailorError(f"{flag} {path} is not writable; to fix: name a file you may write")
