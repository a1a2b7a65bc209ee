"""Fixtures for the store tests: local S3 and GCS servers for the session, a fresh store URI per test.

Import the fixtures a module needs (`from tests.store_fixtures import store_uri, s3_server, ...`).
`store_uri` is parametrized over every backend; the S3 case is marked `s3` and the GCS case `gcp`
(both run in `make test`: the servers are local processes). Each test gets its own prefix, so no
test sees another's files and nothing needs cleaning up; the servers stop at session end.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from profiles_store import ProfileStore, open_store
from profiles_store.local_servers import LocalGcsServer, LocalS3Server
from profiles_store.tables import GPU_TYPES, MODELS
from sailor_core.domain import GIB, GpuType, LayerProfile, LayerSpec, ModelSpec, Provenance

BUCKET = "sailor-tests"
BACKENDS = [
    "local",
    pytest.param("s3", marks=pytest.mark.s3),
    pytest.param("gs", marks=pytest.mark.gcp),
]


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3Server]:
    with LocalS3Server() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[LocalGcsServer]:
    with LocalGcsServer() as server:
        server.create_bucket(BUCKET)
        yield server


@pytest.fixture(params=BACKENDS)
def store_uri(request: pytest.FixtureRequest, tmp_path) -> str:  # noqa: ANN001
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    if request.param == "local":
        return str(tmp_path / "store")
    if request.param == "s3":
        return request.getfixturevalue("s3_server").uri(BUCKET, prefix)
    return request.getfixturevalue("gcs_server").uri(BUCKET, prefix)


# -- small synthetic data --------------------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=UTC)
PROV = Provenance(source="test", host="testhost", recorded_at=T0)


def tiny_model(name: str = "Tiny", blocks: int = 2, tps: tuple[int, ...] = (1, 2)) -> ModelSpec:
    n = blocks + 2
    layers = tuple(
        LayerSpec(
            index=i, kind="embedding" if i == 0 else "head" if i == n - 1 else "block", tp=tp,
            params=1000 * (i + 1) // tp, act_output_elems=64, act_input_elems=64, act_memory_bytes=256 // tp,
        )
        for tp in tps
        for i in range(n)
    )
    return ModelSpec(
        name=name, num_blocks=blocks, hidden_size=8, num_heads=2, sequence_length=8, vocab_size=32, layers=layers
    )


TEST_GPU = GpuType(name="TestGPU", memory_bytes=16 * GIB, gpus_per_node=2, peak_flops=1e12)


def profiles(model: ModelSpec, gpu: str, points: list[tuple[int, int]], scale: float = 1.0) -> list[LayerProfile]:
    return [
        LayerProfile(
            model=model.name,
            gpu_type=gpu,
            mbs=m,
            tp=t,
            layer=i,
            forward_s=scale * 0.001 * (i + 1) * m,
            backward_s=scale * 0.002 * (i + 1) * m,
            optimizer_s=scale * 0.01,
        )
        for m, t in points
        for i in range(model.num_layers)
    ]


def empty_store(uri: str) -> ProfileStore:
    """A store without the seed, with one small model and one GPU type written."""
    store = open_store(uri, seed=False)
    store.write(GPU_TYPES, [TEST_GPU], provenance=PROV)
    store.write(MODELS, [tiny_model()], provenance=PROV)
    return store


class HeldWrites(pafs.FileSystemHandler):
    """A filesystem that delegates to another but holds every write half done: it writes the first half,
    says "writing PATH" on stdout, and goes on only when `release` is set (or after `hold_s`). A test
    kills the writer on that line: in the middle of an upload, for sure, with no sleep to guess by."""

    def __init__(self, inner: pafs.FileSystem, hold_s: float = 120.0) -> None:
        self.inner, self.hold_s = inner, hold_s
        self.release = threading.Event()

    def get_type_name(self) -> str:
        return "held-" + self.inner.type_name

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def equals(self, other: object) -> bool:
        return self is other

    def get_file_info(self, paths):  # noqa: ANN001, ANN201
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector):  # noqa: ANN001, ANN201
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        raise OSError("not supported")

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.inner.copy_file(src, dest)

    def open_input_stream(self, path: str):  # noqa: ANN201
        return self.inner.open_input_stream(path)

    def open_input_file(self, path: str):  # noqa: ANN201
        return self.inner.open_input_file(path)

    def open_append_stream(self, path: str, metadata):  # noqa: ANN001, ANN201
        return self.inner.open_append_stream(path)

    def open_output_stream(self, path: str, metadata):  # noqa: ANN001, ANN201
        inner = self.inner.open_output_stream(path)
        handler = self

        class Held:
            closed = False

            def write(self, data) -> int:  # noqa: ANN001
                view = memoryview(data)
                half = len(view) // 2
                inner.write(view[:half])
                print(f"writing {path}", flush=True)
                handler.release.wait(handler.hold_s)  # the kill is what this waits for
                inner.write(view[half:])
                return len(view)

            def flush(self) -> None:
                inner.flush()

            def close(self) -> None:
                inner.close()
                self.closed = True

        return pa.PythonFile(Held(), mode="w")
