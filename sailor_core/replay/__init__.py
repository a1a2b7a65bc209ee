"""Replay a whole training job over days of availability and price traces, under reaction policies.

Contract: pure (no torch, Prefect, pyarrow or I/O): traces come in as values (trace.py reads text,
synthetic.py generates), the job as a `ReplayJob`, the profiles as a `ProfileBook`. `replay(...)`
runs one policy (policies.py) through the trace with the planner, the simulator and the flow's
switch decision (`sailor_core.decisions.decide_switch`), and returns a `ReplayResult`: time to
train, USD, goodput, GPU-hours wasted on redone steps and reconfiguration, switches, the timeline.
`compare(...)` runs several policies on one shared, memoised planner. See docs/replay.md.
"""

from __future__ import annotations

from collections.abc import Sequence

from sailor_core.errors import TraceError
from sailor_core.planner.risk import DEFAULT_RECONFIGURATION_S
from sailor_core.profiles import ProfileBook
from sailor_core.replay.engine import (
    DEFAULT_GRACE_S,
    DEFAULT_PERIOD_S,
    FAST_SEARCH,
    Action,
    Candidate,
    Planner,
    Policy,
    ReplayJob,
    ReplayResult,
    View,
    replay,
)
from sailor_core.replay.policies import POLICIES, policy_named, relocate
from sailor_core.replay.synthetic import SyntheticSpec, synthetic_trace
from sailor_core.replay.trace import (
    Place,
    Trace,
    TracePoint,
    TraceReading,
    parse_artifact_csv,
    parse_artifact_json,
    parse_changes_csv,
    parse_sailor_trace,
    read_trace,
    trace_to_json,
)
from sailor_core.replay.whatif import check_profiled, ratios, trace_reading, what_if_markdown


def compare(trace: Trace, book: ProfileBook, job: ReplayJob, policies: Sequence[str] = POLICIES) -> list[ReplayResult]:
    """Every named policy over the same trace, sharing one memoised planner."""
    planner = Planner(book, job)
    return [replay(trace, book, job, policy_named(p), name=p, planner=planner,
                   period_s=job.period_s if p == "periodic" else None) for p in policies]


__all__ = [
    "DEFAULT_GRACE_S", "DEFAULT_PERIOD_S", "DEFAULT_RECONFIGURATION_S", "FAST_SEARCH", "POLICIES", "Action",
    "Candidate", "Place", "Planner", "Policy", "ReplayJob", "ReplayResult", "SyntheticSpec", "Trace", "TraceError",
    "TracePoint", "TraceReading", "View", "check_profiled", "compare", "parse_artifact_csv", "parse_artifact_json",
    "parse_changes_csv", "parse_sailor_trace", "policy_named", "ratios", "read_trace", "relocate", "replay",
    "synthetic_trace", "trace_reading", "trace_to_json", "what_if_markdown",
]
