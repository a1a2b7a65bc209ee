"""The flow's what-if: the job replayed over an availability and price trace before anything is rented.

Contract: `what_if(run_id, trace_path, book, request, ...)` reads the trace (any format `sailor replay`
reads, or `synthetic`: the generator's defaults over the store's prices), replays the job under every
policy on one shared memoised planner (sailor_core.replay, the replay's fast search), publishes the
side-by-side table as a Prefect markdown artifact (key `what-if-<run id>`: the UI's Artifacts tab),
writes a `what_if` event with the figures to the run history and returns them. The job is the run's:
its model, batch, steps, objective, limits and restrictions (from the `PlanRequest` the flow would
plan with), checkpoint interval, reconfiguration estimate and min_gain. A trace that cannot be read
or offers GPU types the store cannot time raises SailorError (one line, to fix), before anything is
rented.
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from sailor_core.errors import SailorError
from sailor_core.planner import PlanRequest, SearchOptions
from sailor_core.profiles import ProfileBook
from sailor_core.replay import (
    FAST_SEARCH,
    ReplayJob,
    SyntheticSpec,
    Trace,
    check_profiled,
    compare,
    ratios,
    read_trace,
    synthetic_trace,
    trace_reading,
    what_if_markdown,
)
from tasks.history import RunEvent, RunHistory
from tasks.reporting import artifact_key


def load_trace(path: str, book: ProfileBook) -> Trace:
    """The trace at `path` (or `synthetic`), read against the store's profiles and prices."""
    how = trace_reading(book)
    if path == "synthetic":
        return synthetic_trace(SyntheticSpec(), how.prices, how.gpus_per_node)
    p = Path(path)
    if not p.is_file():
        raise SailorError(f"what-if trace {path} does not exist; to fix: name a trace file (docs/replay.md) or "
                          f"'synthetic'")
    return read_trace(p.name, p.read_text(), how)


def job_of(request: PlanRequest, *, total_steps: int, sequence_length: int, checkpoint_interval: int,
           reconfiguration_s: float, min_gain: float) -> ReplayJob:
    search = SearchOptions(**{**FAST_SEARCH, "max_stages": request.options.max_stages})
    return ReplayJob(model=request.model, global_batch_size=request.global_batch_size, total_steps=total_steps,
                     tokens_per_step=request.global_batch_size * sequence_length,
                     objective=request.objective.value, constraints=request.constraints,
                     restrictions=request.restrictions, search=search, checkpoint_interval=checkpoint_interval,
                     reconfiguration_s=reconfiguration_s, min_gain=min_gain)


@task(name="what-if replay", cache_policy=NO_CACHE)
def what_if(run_id: str, trace_path: str, book: ProfileBook, job: ReplayJob,
            history: RunHistory) -> dict[str, object]:
    tr = load_trace(trace_path, book)
    check_profiled(tr, book)
    results = compare(tr, book, job)
    markdown = what_if_markdown(tr, job, results)
    create_markdown_artifact(key=artifact_key("what-if", run_id), markdown=markdown,
                             description="What-if before renting: the job replayed over a trace, per policy")
    rt = ratios(results)
    doc = {"trace": tr.name, "model": job.model, "total_steps": job.total_steps,
           "results": [r.to_json() for r in results], "sailor_vs_relaunch_same": rt}
    best = min(results, key=lambda r: (not r.finished, r.time_to_train_s))
    history.event(run_id, RunEvent.WHAT_IF, f"what-if over {tr.name}: {best.policy} finishes first "
                                     f"({best.time_to_train_s / 3600:.2f} h, {best.usd:.2f} USD)", doc)
    return doc
