"""Every error Sailor raises on purpose, in one tree with one root.

Contract: each class below derives from `SailorError`; no other module defines an error class
(they import theirs from here, and old import paths re-export them). A message is one line,
"what was wrong; to fix: ...". Where a caller needs to know *what* went wrong (which profile is
missing), the error carries it in fields: callers read the fields, never parse the message. The
branch decides who can fix it: `Failure` and below are failures of the outside world or of a job
(the CLI exits 1, a retry may help); everything else is the user's to fix (exit 2). The CLI's
table of exit codes is keyed by these classes (`sailor_cli.main.EXIT_CODES`). Pure: no imports.

    SailorError                    the user can fix it (exit 2)
    ├── ValidationError            a domain value is invalid (also a ValueError)
    ├── InvalidParameters          the flow's parameters; nothing was provisioned
    ├── PlanFormatError            a plan file is malformed
    ├── PoolFileError              a pool file is malformed
    ├── ScenarioError              a scenario file is malformed
    ├── TraceError                 a trace file is malformed or cannot be priced
    ├── PlanInvalidError           a plan breaks structural rules (the simulator's check)
    ├── MissingProfileError        a plan needs a profile the store lacks (fields: kind, model, gpu_type, ...)
    ├── NoPlanError                no plan satisfies the request with what can be rented now
    ├── StoreError                 the store cannot be reached, read or written
    ├── UnknownModelError          the store has no layer specs for a model
    ├── UnknownGpuTypeError        the store does not know a GPU type
    ├── UnknownRunError            no run with that id in the store
    ├── ProfilingWorkerError       a profiling worker raised, died or timed out (fields: rank, out_of_memory)
    └── Failure                    the outside world or a job failed (exit 1)
        ├── ProviderError          a provider call failed
        │   ├── CapacityError      no capacity for the request (the caller may fall back)
        │   └── TestbedError       building or using the local testbed failed
        ├── CloudUnreachable       the cloud's API did not answer
        ├── MetadataUnavailable    a VM's metadata service did not answer
        ├── ProtocolError          the run's controller refused a request or could not be reached
        ├── StorageUnavailable     object storage kept failing past the retry deadline (never "not found")
        ├── PeerLost               a worker was lost while this rank waited on it (also a RuntimeError)
        └── TrainingFailed         the job failed while training
"""

from __future__ import annotations

from typing import Literal


class SailorError(Exception):
    """An error Sailor raises on purpose. Unless it is a `Failure`, the user can cause and fix it; the
    CLI prints it as one line (`error: ...; to fix: ...`) without a traceback."""


class ValidationError(SailorError, ValueError):
    """A domain value is invalid. The message names the field, the value and how to fix it.

    Also a `ValueError`: parsers (`Market.parse`, `int(...)` alike) are caught as `ValueError`s."""


class InvalidParameters(SailorError):
    """The flow's parameters are invalid; nothing was provisioned."""


class PlanFormatError(SailorError):
    """A plan file is malformed or invalid; the message lists every problem."""


class PoolFileError(SailorError):
    """A pool file is malformed; the message lists every problem."""


class ScenarioError(SailorError):
    """A scenario file is malformed; the message lists every problem."""


class TraceError(SailorError):
    """A trace file is malformed or cannot be priced."""


class PlanInvalidError(SailorError):
    """The plan breaks structural rules; the message lists every violation."""


MissingKind = Literal["layers", "gpu-type", "link", "intra-node", "vm"]
# A network link's key in a ProfileBook: (sender_zone, sender_gpu, sender_count, receiver_zone,
# receiver_gpu, receiver_count).
LinkKey = tuple[str, str, int, str, str, int]


class MissingProfileError(SailorError):
    """A plan needs a profile the store lacks. The fields say which one:

    - `kind`: "layers" (per-layer times of `model` on `gpu_type` at `mbs`, `tp`), "gpu-type" (the
      GPU type itself), "link" (a network fit between two GPU groups, `link`), "intra-node" (GPUs of
      one node talking to each other, `gpu_type`), "vm" (no VM to measure it on can be rented);
    - `what`: that key in words, without the fix (the planner lists these); `fix`: the command or
      choice that would make it present. The message is "`what`; to fix: `fix`".
    """

    def __init__(self, what: str, *, fix: str | None = None, kind: MissingKind | None = None,
                 model: str | None = None, gpu_type: str | None = None, mbs: int | None = None,
                 tp: int | None = None, link: LinkKey | None = None) -> None:
        # `what` alone is also how pickle rebuilds the error (with the full message); the fields follow.
        super().__init__(what if fix is None else f"{what}; to fix: {fix}")
        self.what = what
        self.fix = fix
        self.kind = kind
        self.model = model
        self.gpu_type = gpu_type
        self.mbs = mbs
        self.tp = tp
        self.link = link


class NoPlanError(SailorError):
    """No plan satisfies the request with what can be rented now."""


class StoreError(SailorError):
    """The store cannot be reached, read or written; the message says how to fix it."""


class UnknownModelError(SailorError):
    """The store has no layer specs for a model."""


class UnknownGpuTypeError(SailorError):
    """The store does not know a GPU type."""


class UnknownRunError(SailorError):
    """No run with that id in the store."""


class ProfilingWorkerError(SailorError):
    """A profiling worker process raised, died or outlived its time (sailor_core.profiler.spawn).

    Fields: `rank` of the worker (None when the group ran out of time), `returncode` of a worker that
    died without a word (-9: killed, as by the kernel's out-of-memory killer), and `out_of_memory`:
    the worker's own error was an out-of-memory error, or it was killed so.
    """

    def __init__(self, message: str, *, rank: int | None = None, returncode: int | None = None,
                 out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.returncode = returncode
        self.out_of_memory = out_of_memory


class Failure(SailorError):
    """The outside world (a cloud, a VM, the network) or a job failed, not the user's input: the CLI
    exits 1, and a retry may succeed. The message still says what to try."""


class ProviderError(Failure):
    """A provider call failed; the message says what and how to fix it."""


class CapacityError(ProviderError):
    """The cloud has no capacity for the request in that zone (the caller may fall back)."""


class TestbedError(ProviderError):
    """Building or using the local provider's testbed failed; the message says what and how to fix it."""

    __test__ = False  # not a pytest class


class CloudUnreachable(Failure):
    """The cloud's API did not answer (network, endpoint, outage)."""


class MetadataUnavailable(Failure):
    """The metadata service did not answer (not on a VM of that cloud, or a transient failure)."""


class ProtocolError(Failure):
    """The run's controller refused a request or could not be reached."""


class StorageUnavailable(Failure):
    """Object storage kept failing (5xx, timeouts, reset connections) past the retry deadline. Never
    read as "not there": a checkpoint that cannot be listed is not a checkpoint that does not exist."""


class PeerLost(Failure, RuntimeError):
    """The controller announced a lost worker while this rank was waiting on communication.

    Also a `RuntimeError`, as torch's failed collectives are."""


class TrainingFailed(Failure):
    """The job failed while training (a worker's error, no plan left)."""
