"""A replay as a what-if: the pieces `sailor replay` and the flow share (pure: no I/O, no Prefect).

Contract: `trace_reading(book, ...)` is how traces lacking a field are read against the store's
profiles (GPUs per node, the store's prices unless one price is given); `check_profiled(trace,
book)` refuses a trace offering GPU types the book cannot time (one line, to fix); `ratios(results)`
is Sailor's policy against relaunch-same (time and cost ratios, sooner, cheaper);
`what_if_markdown(trace, job, results)` is the side-by-side table a person reads before renting
anything (the flow publishes it as a Prefect artifact).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sailor_core.domain import Market
from sailor_core.errors import SailorError
from sailor_core.profiles import ProfileBook
from sailor_core.replay.engine import ReplayJob, ReplayResult
from sailor_core.replay.trace import Trace, TraceReading


def trace_reading(book: ProfileBook, *, zone: str = "us-central1-a", gpu_type: str = "A100-40",
                  market: Market = Market.ON_DEMAND, default_count: int | None = None,
                  price: float | None = None) -> TraceReading:
    def gpn(g: str) -> int:
        known = book.gpu_types.get(g)
        return known.gpus_per_node if known else 1

    def prices(z: str, g: str, m: Market) -> float | None:
        return price if price is not None else book.price_usd_per_gpu_hour(z, g, m)

    return TraceReading(prices=prices, gpus_per_node=gpn, zone=zone, gpu_type=gpu_type, market=market,
                        default_count=default_count)


def check_profiled(tr: Trace, book: ProfileBook) -> None:
    unknown = sorted({p.gpu_type for p in tr.places if not book.profiled_points(p.gpu_type)})
    if unknown:
        raise SailorError(f"the trace offers {', '.join(unknown)}, which the store has no {book.model.name} profile "
                          f"for; to fix: profile them (sailor profile model) or drop those columns")


def ratios(results: Sequence[ReplayResult]) -> dict[str, Any] | None:
    by = {r.policy: r for r in results}
    s, b = by.get("sailor"), by.get("relaunch-same")
    if s is None or b is None or not s.finished:
        return None
    out: dict[str, Any] = {"baseline": "relaunch-same", "baseline_finished": b.finished}
    # An unfinished baseline has not reached the budget: its time and spend so far are lower bounds.
    out["time_ratio"] = s.time_to_train_s / b.time_to_train_s if b.time_to_train_s else None
    out["cost_ratio"] = s.usd / b.usd if b.usd else None
    out["sooner"] = (not b.finished) or s.time_to_train_s < b.time_to_train_s
    out["cheaper"] = b.finished and s.usd < b.usd
    return out


def what_if_markdown(tr: Trace, job: ReplayJob, results: Sequence[ReplayResult]) -> str:
    """The replay per policy as a markdown table, with how Sailor's policy compares with relaunch-same."""
    lines = [
        f"### What-if: {job.model} over {tr.name}",
        "",
        f"{job.total_steps} steps ({job.total_steps * job.tokens_per_step:.3g} tokens), objective {job.objective}; "
        f"{len(tr.points)} changes over {tr.duration_s / 3600:.1f} h, up to {tr.max_gpus} GPUs; reconfiguration "
        f"{job.reconfiguration_s:.1f} s, checkpoint every {job.checkpoint_interval} steps. Simulated, nothing rented.",
        "",
        "| policy | finished | hours | USD | useful steps/s | wasted GPU-h | switches | waiting h |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        done = "yes" if r.finished else f"no ({r.steps_done:.0f} steps)"
        lines.append(f"| {r.policy} | {done} | {r.time_to_train_s / 3600:.2f} | {r.usd:.2f} | "
                     f"{r.goodput_steps_per_s:.4g} | {r.gpu_hours_wasted:.2f} | {r.switches} | "
                     f"{r.waiting_s / 3600:.2f} |")
    rt = ratios(results)
    if rt and rt["time_ratio"] is not None and rt["cost_ratio"] is not None:
        lines += ["", f"sailor vs relaunch-same: time x{rt['time_ratio']:.3f}, cost x{rt['cost_ratio']:.3f}"
                  + ("" if rt["baseline_finished"] else " (relaunch-same did not finish: lower bounds)")]
    return "\n".join(lines)
