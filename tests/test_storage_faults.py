"""Object-storage faults never read as "no checkpoint": a hiccup is retried, an outage fails loudly.

A real S3 server (rclone, tests/store_fixtures.py) behind tests/fakes/fault_proxy.py, which answers
503, resets connections or holds them unanswered for a while. Before RetryingStorage, one failed
listing made `checkpoint_steps` answer None and the flow hand out `resume=False, start_step=0`.
"""

from __future__ import annotations

import errno
import uuid
from urllib.parse import quote

import pytest
import torch

from sailor_core.errors import StorageUnavailable
from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime.checkpoint_storage import CheckpointStorage, RetryingStorage
from sailor_core.runtime.checkpoint_writer import AsyncCheckpointer
from tasks.control import checkpoint_steps
from tests.fakes.fault_proxy import FaultProxy
from tests.store_fixtures import BUCKET, s3_server  # noqa: F401 - a fixture

NUM_LAYERS = 2


def _uri_through(server, proxy: FaultProxy, prefix: str) -> str:  # noqa: ANN001
    uri = server.uri(BUCKET, prefix)
    return uri.replace(quote(server.endpoint, safe=""), quote(proxy.endpoint, safe=""))


def _write_checkpoint(storage: CheckpointStorage, step: int) -> None:
    states = {li: {"layer": li, "tp": 1, "tp_rank": 0, "shard_dims": {"w": None}, "params": {"w": torch.ones(4)},
                   "exp_avg": {"w": torch.zeros(4)}, "exp_avg_sq": {"w": torch.zeros(4)}} for li in range(NUM_LAYERS)}
    meta = {"step": step, "num_layers": NUM_LAYERS, "model": "test"}
    w = AsyncCheckpointer(storage)
    w.save(step, states, "part_s0_t0.json", meta, blocking=True, prune=False)


@pytest.fixture
def proxied(s3_server):  # noqa: F811
    with FaultProxy("127.0.0.1", s3_server.port) as proxy:
        uri = _uri_through(s3_server, proxy, f"ck-{uuid.uuid4().hex[:10]}")
        _write_checkpoint(ckpt.open_storage(uri), 7)
        yield proxy, uri


@pytest.mark.s3
def test_a_short_outage_is_retried_and_the_checkpoint_found(proxied):
    proxy, uri = proxied
    proxy.fault("503", seconds=3)
    assert checkpoint_steps(uri, NUM_LAYERS, retry_s=60) == 7
    assert proxy.faulted_connections > 0  # the fault was really met, not missed


@pytest.mark.s3
@pytest.mark.parametrize("kind", ["503", "reset"])
def test_an_outage_past_the_deadline_is_an_error_not_no_checkpoint(proxied, kind):
    proxy, uri = proxied
    proxy.fault(kind)
    with pytest.raises(StorageUnavailable, match="kept failing"):
        checkpoint_steps(uri, NUM_LAYERS, retry_s=2)
    proxy.heal()
    assert checkpoint_steps(uri, NUM_LAYERS, retry_s=2) == 7


@pytest.mark.s3
def test_a_resume_during_an_outage_quarantines_nothing(proxied):
    """A checkpoint whose meta.json could not be read for a moment is valid: it must not be moved aside."""
    proxy, uri = proxied
    proxy.fault("reset", seconds=2)
    step, skipped = ckpt.resume_point(ckpt.open_storage(uri, retry_s=60), NUM_LAYERS)
    assert (step, skipped) == (7, [])


class _Flaky:
    """A storage whose listing fails `n` times with `error`, then works."""

    def __init__(self, n: int, error: OSError) -> None:
        self.n, self.error, self.calls = n, error, 0

    def listdir(self, path: str) -> list[str]:
        self.calls += 1
        if self.calls <= self.n:
            raise self.error
        return ["step_00000003"]


def _retrying(inner: _Flaky, retry_s: float) -> RetryingStorage:
    now = [0.0]
    return RetryingStorage(inner, retry_s=retry_s, sleep=lambda s: now.__setitem__(0, now[0] + s),  # type: ignore[arg-type]
                                clock=lambda: now[0])


def test_retries_back_off_until_the_deadline():
    inner = _Flaky(100, OSError("AWS Error UNKNOWN (HTTP status 503) during ListObjectsV2 operation"))
    with pytest.raises(StorageUnavailable):
        _retrying(inner, retry_s=30).listdir("")
    # 0.5, 1, 2, 4, 8, 8, 8 ... seconds apart: a handful of tries in 30 s, not thousands
    assert 5 <= inner.calls <= 10
    inner = _Flaky(3, OSError("Connection reset by peer"))
    assert _retrying(inner, retry_s=30).listdir("") == ["step_00000003"] and inner.calls == 4


@pytest.mark.parametrize("error", [FileNotFoundError(errno.ENOENT, "no such key"),
                                   OSError(errno.ENOSPC, "No space left on device"),
                                   OSError("AWS Error ACCESS_DENIED during GetObject operation: (HTTP status 403)")])
def test_absence_and_permanent_errors_are_not_retried(error):
    inner = _Flaky(1, error)
    with pytest.raises(type(error)):
        _retrying(inner, retry_s=30).listdir("")
    assert inner.calls == 1
