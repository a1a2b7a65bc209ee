"""The store contract: what every backend (local folder, S3, GCS) must do, run once per backend.

Each test gets a fresh store at its own prefix (tests.store_fixtures.store_uri). Covers round trips
of every table, replace/upsert semantics, the seed as a base layer, concurrent writers, an
interrupted (killed) writer, leftovers of dead writers, corrupt files and files of another schema
version.
"""

# ruff: noqa: F811  (pytest fixtures imported from tests.store_fixtures are test arguments)
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from profiles_store import HistoryRecord, StoreError, UnknownGpuTypeError, UnknownModelError, open_store
from profiles_store.backend import TMP_PREFIX
from profiles_store.eth_easl import read_eth_easl
from profiles_store.schemas import META_TABLE, META_VERSION, SCHEMA_VERSION, TABLES
from profiles_store.store import SEED_DIR
from profiles_store.tables import (
    EGRESS_PRICES,
    FRAMEWORK_OVERHEAD,
    GPU_PRICES,
    INTRA_NODE_LINKS,
    LAYER_PROFILES,
    MODELS,
    NETWORK_LINKS,
    NODE_ALLREDUCE,
    QUOTAS,
    Quota,
)
from sailor_core.domain import (
    BandwidthFit,
    Capacity,
    EgressPrice,
    GpuPrice,
    IntraNodeLink,
    Market,
    NetworkLink,
    NodeAllReduce,
    Provenance,
)
from sailor_core.errors import SailorError
from tests.paths import PUBLISHED_DATA, REFERENCE_DATA, REPO
from tests.store_fixtures import (  # noqa: F401 - fixtures
    PROV,
    T0,
    TEST_GPU,
    empty_store,
    gcs_server,
    profiles,
    s3_server,
    store_uri,
    tiny_model,
)

FIT = BandwidthFit(coeffs=(0.01, 0.2, 1.5), max_bytes_per_s=2e9, latency_s=1e-5)


def _file_count(store, table: str) -> int:
    return len([i for i in store.location.list_files(store.location.path(table)) if i.path.endswith(".parquet")])


# -- round trips ------------------------------------------------------------------------------


def test_empty_store_without_seed_has_nothing(store_uri):
    store = open_store(store_uri, seed=False)
    assert store.list_pairs() == []
    assert store.model_names() == []
    for name in TABLES:
        assert store.read_table(name).num_rows == 0
    with pytest.raises(UnknownModelError, match="unknown model 'OPT-350'"):
        store.profile_book("OPT-350")


def test_model_and_layer_profiles_round_trip(store_uri):
    store = empty_store(store_uri)
    model = tiny_model()
    assert store.model("Tiny") == model
    rows = profiles(model, "TestGPU", [(1, 1), (2, 1), (1, 2)])
    assert store.replace_layer_profiles("Tiny", "TestGPU", rows, provenance=PROV) == len(rows)
    assert set(store.read(LAYER_PROFILES, {"model": "Tiny"})) == set(rows)
    book = store.profile_book("Tiny", ["TestGPU"])
    assert book.model == model
    assert book.profiled_points("TestGPU") == [(1, 1), (1, 2), (2, 1)]
    assert [p.layer for p in book.layers("TestGPU", 2, 1)] == list(range(model.num_layers))
    assert book.gpu("TestGPU") == TEST_GPU
    [pair] = store.list_pairs()
    assert (pair.model, pair.gpu_type, pair.rows, pair.layers, pair.mbs, pair.tp) == (
        "Tiny",
        "TestGPU",
        len(rows),
        4,
        (1, 2),
        (1, 2),
    )
    assert (pair.source, pair.host, pair.recorded_at) == ("test", "testhost", T0)


def test_every_profile_table_round_trips_with_provenance(store_uri):
    store = empty_store(store_uri)
    links = [
        NetworkLink(sender_zone="z-a", sender_gpu="TestGPU", sender_count=c, receiver_zone="z-b",
                    receiver_gpu="TestGPU", receiver_count=c, fit=FIT)
        for c in (1, 2)
    ]
    intra = [IntraNodeLink(gpu_type="TestGPU", num_gpus=2, fit=FIT)]
    node_ar = [NodeAllReduce(gpu_type="TestGPU", workers=w, fit=FIT) for w in (2, 4)]
    egress = [EgressPrice(sender_zone="z-a", receiver_zone="z-b", usd_per_gb=0.02)]
    prices = [
        GpuPrice(cloud="gcp", zone="z-a", gpu_type="TestGPU", market=Market.SPOT, usd_per_gpu_hour=1.25, fetched_at=T0)
    ]
    quotas = [Capacity(zone="z-a", region="z", gpu_type="TestGPU", gpus=8, market=Market.SPOT, cloud="gcp")]
    store.write(NETWORK_LINKS, links, provenance=PROV)
    store.write(INTRA_NODE_LINKS, intra, provenance=PROV)
    store.write(NODE_ALLREDUCE, node_ar, provenance=PROV)
    store.write(EGRESS_PRICES, egress, provenance=PROV)
    store.write(GPU_PRICES, prices, provenance=PROV)
    store.write(QUOTAS, [Quota.of(c) for c in quotas], provenance=PROV)
    store.write(FRAMEWORK_OVERHEAD, [("TestGPU", 3_000_000_000)], provenance=PROV)

    assert set(store.read(NETWORK_LINKS)) == set(links)
    assert store.read(INTRA_NODE_LINKS) == tuple(intra)
    assert set(store.read(NODE_ALLREDUCE)) == set(node_ar)
    assert store.read(EGRESS_PRICES) == tuple(egress)
    assert store.read(GPU_PRICES) == tuple(prices)
    [q] = store.quotas()
    assert (q.zone, q.gpu_type, q.gpus, q.market, q.gpus_per_vm, q.usd_per_gpu_hour) == (
        "z-a",
        "TestGPU",
        8,
        Market.SPOT,
        2,
        1.25,
    )
    assert dict(store.read(FRAMEWORK_OVERHEAD)) == {"TestGPU": 3_000_000_000}
    book = store.profile_book("Tiny")
    assert book.link("z-a", "TestGPU", 2, "z-b", "TestGPU", 2) == links[1]
    assert book.intra_node_link("TestGPU", 2) == intra[0]
    assert book.node_allreduce_fit("TestGPU", 4) == node_ar[1] and book.node_allreduce_fit("TestGPU", 3) is None
    assert book.egress_usd_per_gb("z-a", "z-b") == 0.02
    assert book.price_usd_per_gpu_hour("z-a", "TestGPU", Market.SPOT) == 1.25
    assert book.overhead_bytes("TestGPU") == 3_000_000_000
    for name in (
        "network_links",
        "intra_node_links",
        "node_allreduce",
        "egress_prices",
        "gpu_prices",
        "quotas",
        "framework_overhead",
    ):
        t = store.read_table(name)
        assert set(t["source"].to_pylist()) == {"test"}, name
        assert set(t["host"].to_pylist()) == {"testhost"}, name
        assert set(t["recorded_at"].to_pylist()) == {T0}, name


def test_run_history_appends_and_filters(store_uri):
    store = open_store(store_uri, seed=False)
    recs = [
        HistoryRecord(run_id="run-1", kind="preemption", time=T0 + timedelta(seconds=i), reason=f"vm {i} lost",
                      payload={"vm": f"vm-{i}", "gpus": i})
        for i in range(3)
    ]
    store.append_history("events", recs[:2])
    store.append_history("events", recs[2:])
    store.append_history("events", [HistoryRecord(run_id="run-2", kind="price", time=T0, payload={"usd": 1.5})])
    got = store.read_history("events", run_id="run-1")
    assert [(r.kind, r.reason, dict(r.payload), r.time) for r in got] == [
        (r.kind, r.reason, dict(r.payload), r.time) for r in recs
    ]
    assert [r.run_id for r in store.read_history("events")] == ["run-1", "run-2", "run-1", "run-1"]
    assert [r.run_id for r in store.read_history("events", kind="price")] == ["run-2"]
    for table in ("runs", "decisions", "plans", "measurements"):
        store.append_history(table, [HistoryRecord(run_id="run-1", kind="k", time=T0, payload={"t": table})])
        assert store.read_history(table)[0].payload == {"t": table}
    with pytest.raises(SailorError, match="not a run-history table"):
        store.append_history("layer_profiles", recs)


# -- replace, upsert, latest ------------------------------------------------------------------


def test_replace_supersedes_and_retires_older_files(store_uri):
    store = empty_store(store_uri)
    model = tiny_model()
    store.replace_layer_profiles("Tiny", "TestGPU", profiles(model, "TestGPU", [(1, 1), (2, 1)]), provenance=PROV)
    second = profiles(model, "TestGPU", [(4, 2)], scale=2.0)
    store.replace_layer_profiles("Tiny", "TestGPU", second, provenance=PROV)
    assert set(store.read(LAYER_PROFILES, {"model": "Tiny", "gpu_type": ["TestGPU"]})) == set(second)
    assert _file_count(store, "layer_profiles") == 1
    # An empty replace empties the partition.
    store.replace_layer_profiles("Tiny", "TestGPU", [], provenance=PROV)
    assert store.read(LAYER_PROFILES, {"model": "Tiny"}) == ()


def test_upsert_newest_write_wins_and_prices_keep_history(store_uri):
    store = empty_store(store_uri)
    egress = [
        EgressPrice(sender_zone="a", receiver_zone="b", usd_per_gb=0.01),
        EgressPrice(sender_zone="a", receiver_zone="c", usd_per_gb=0.02),
    ]
    store.write(EGRESS_PRICES, egress)
    store.write(EGRESS_PRICES, [EgressPrice(sender_zone="a", receiver_zone="b", usd_per_gb=0.05)])
    assert {(e.receiver_zone, e.usd_per_gb) for e in store.read(EGRESS_PRICES)} == {("b", 0.05), ("c", 0.02)}

    def price(usd: float, at) -> GpuPrice:  # noqa: ANN001
        return GpuPrice(cloud="gcp", zone="z", gpu_type="TestGPU", market="spot", usd_per_gpu_hour=usd, fetched_at=at)

    store.write(GPU_PRICES, [price(2.0, T0 + timedelta(hours=1))])
    store.write(GPU_PRICES, [price(1.0, T0)])  # an older fetch written late must not hide the newer price
    assert [p.usd_per_gpu_hour for p in store.read(GPU_PRICES)] == [2.0]
    assert sorted(p.usd_per_gpu_hour for p in store.read(GPU_PRICES, latest=False)) == [1.0, 2.0]


# -- the seed as a base layer -----------------------------------------------------------------


def test_seed_lists_every_published_pair_and_matches_the_reader(store_uri):
    store = open_store(store_uri)
    pairs = {(p.model, p.gpu_type) for p in store.list_pairs()}
    # the published files shipped in tests/data (a subset of the tree the seed was built from)
    data = read_eth_easl(PUBLISHED_DATA)
    assert len(pairs) == 17 and set(data.layer_profile_files) < pairs
    ref = data.profile_book("GPT-Neo-2.7")
    book = store.profile_book("GPT-Neo-2.7")
    assert book.layer_profiles == ref.layer_profiles
    assert set(book.model.layers) == set(ref.model.layers)
    assert set(ref.links) < set(book.links) and set(book.prices) == set(ref.prices)
    book = store.profile_book("OPT-350", ["A100-40", "V100-16", "GH-96"])
    assert book.price_usd_per_gpu_hour("us-central1-c", "A100-40", Market.ON_DEMAND) == 3.673385
    assert book.price_usd_per_gpu_hour("us-west1-b", "V100-16", Market.ON_DEMAND) == 2.859998
    assert book.price_usd_per_gpu_hour("us-central1-a", "GH-96", Market.ON_DEMAND) == 11.06
    assert len(book.layers("GH-96", 1, 4)) == 26


@pytest.mark.skipif(not REFERENCE_DATA.exists(), reason="needs the whole published tree (../shared/reference_data)")
def test_seed_holds_exactly_the_whole_published_tree():
    seed = open_store(str(SEED_DIR), seed=False)
    data = read_eth_easl(REFERENCE_DATA)
    assert {(p.model, p.gpu_type) for p in seed.list_pairs()} == set(data.layer_profile_files)
    assert set(seed.profile_book("GPT-Neo-2.7").links) == set(data.links)


def test_store_rows_override_the_seed_without_touching_it(store_uri):
    seed_files = sorted(p.name for p in SEED_DIR.rglob("*"))
    store = open_store(store_uri)
    model = store.model("OPT-350")
    mine = profiles(model, "A100-40", [(3, 1)])
    store.replace_layer_profiles("OPT-350", "A100-40", mine, provenance=PROV)
    store.write(GPU_PRICES, [GpuPrice(cloud="gcp", zone="us-central1-a", gpu_type="A100-40", market="on-demand",
                                 usd_per_gpu_hour=1.0, fetched_at=T0 + timedelta(days=400))])
    book = store.profile_book("OPT-350", ["A100-40", "V100-16"])
    assert book.profiled_points("A100-40") == [(3, 1)]
    assert len(book.profiled_points("V100-16")) > 5  # still the seed's
    assert book.price_usd_per_gpu_hour("us-central1-a", "A100-40", Market.ON_DEMAND) == 1.0
    assert book.price_usd_per_gpu_hour("us-central1-b", "A100-40", Market.ON_DEMAND) == 3.673385
    assert sorted(p.name for p in SEED_DIR.rglob("*")) == seed_files
    assert len(open_store(store_uri, seed=False).list_pairs()) == 1


# -- bad input --------------------------------------------------------------------------------


def test_unknown_model_and_gpu_type_are_one_line_errors(store_uri):
    store = empty_store(store_uri)
    with pytest.raises(UnknownModelError) as e:
        store.profile_book("GPT-5")
    assert (
        "'GPT-5'" in str(e.value) and "Tiny" in str(e.value) and "to fix" in str(e.value) and "\n" not in str(e.value)
    )
    with pytest.raises(UnknownGpuTypeError, match=r"unknown GPU type\(s\) \['H100'\].*TestGPU.*to fix"):
        store.profile_book("Tiny", ["TestGPU", "H100"])
    with pytest.raises(UnknownGpuTypeError):
        store.replace_layer_profiles("Tiny", "H100", [], provenance=PROV)
    with pytest.raises(UnknownModelError):
        store.replace_layer_profiles("GPT-5", "TestGPU", [], provenance=PROV)
    with pytest.raises(SailorError, match="outside model Tiny's layers"):
        store.replace_layer_profiles(
            "Tiny", "TestGPU", profiles(tiny_model(blocks=5), "TestGPU", [(1, 1)]), provenance=PROV
        )


def _bad_file_path(store, table: str) -> str:
    """A committed-looking file name that sorts after everything written so far."""
    return store.location.path(table, f"part-{time.time_ns() + 10**9:020d}-badbadbadbadbad0-upsert.parquet")


def test_corrupt_or_truncated_file_is_named_and_deleting_it_recovers(store_uri):
    store = empty_store(store_uri)
    store.write(EGRESS_PRICES, [EgressPrice(sender_zone="a", receiver_zone="b", usd_per_gb=0.01)])
    good = store.location.get(store.location.list_files(store.location.path("egress_prices"))[0].path)
    bad = _bad_file_path(store, "egress_prices")
    store.location.put(bad, good[: len(good) // 2])  # truncated
    with pytest.raises(StoreError) as e:
        store.read(EGRESS_PRICES)
    msg = str(e.value)
    assert "not a readable Parquet file" in msg and bad.rsplit("/", 1)[1] in msg and "to fix: delete" in msg
    assert "\n" not in msg
    store.location.put(bad, b"garbage" * 10)  # not Parquet at all
    with pytest.raises(StoreError, match="not a readable Parquet file"):
        store.read(EGRESS_PRICES)
    store.location.delete(bad)
    assert [e.usd_per_gb for e in store.read(EGRESS_PRICES)] == [0.01]


def _parquet_bytes(table: pa.Table) -> bytes:
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    return buf.getvalue().to_pybytes()


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 0])
def test_file_of_another_schema_version_is_refused(store_uri, version):
    store = empty_store(store_uri)
    spec = TABLES["egress_prices"]
    t = store._to_table(spec, [dict(sender_zone="a", receiver_zone="b", usd_per_gb=0.01)], PROV)
    t = t.replace_schema_metadata({META_TABLE: b"egress_prices", META_VERSION: str(version).encode()})
    store.location.put(_bad_file_path(store, "egress_prices"), _parquet_bytes(t))
    with pytest.raises(StoreError) as e:
        store.read(EGRESS_PRICES)
    assert f"schema version {version}" in str(e.value)
    assert ("upgrade" if version > SCHEMA_VERSION else "rewrite") in str(e.value)


def test_foreign_parquet_file_with_other_columns_is_refused(store_uri):
    store = empty_store(store_uri)
    store.location.put(_bad_file_path(store, "egress_prices"), _parquet_bytes(pa.table({"x": [1, 2]})))
    with pytest.raises(StoreError, match=r"does not have the columns of table egress_prices.*missing"):
        store.read(EGRESS_PRICES)


def test_store_marker_of_another_version_is_refused_at_open(store_uri):
    store = empty_store(store_uri)
    store.location.put(
        store.location.path("_sailor_store.json"), json.dumps({"schema_version": SCHEMA_VERSION + 1}).encode()
    )
    with pytest.raises(StoreError, match=f"schema version {SCHEMA_VERSION + 1}.*upgrade"):
        open_store(store_uri)


def test_rows_that_do_not_fit_the_schema_write_nothing(store_uri):
    store = empty_store(store_uri)
    before = store.read_table("gpu_types")
    with pytest.raises(SailorError, match="do not fit its schema"):
        store.write_table("gpu_types", [dict(gpu_type="X", memory_bytes="lots", gpus_per_node=1)])
    with pytest.raises(SailorError, match="empty 'memory_bytes'"):
        store.write_table("gpu_types", [dict(gpu_type="X", gpus_per_node=1)])
    assert store.read_table("gpu_types").equals(before)


# -- atomicity and concurrency ----------------------------------------------------------------


def test_leftovers_of_dead_writers_are_invisible(store_uri, request):
    store = empty_store(store_uri)
    model = tiny_model()
    rows = profiles(model, "TestGPU", [(1, 1)])
    store.replace_layer_profiles("Tiny", "TestGPU", rows, provenance=PROV)
    part = store.location.path("layer_profiles", "model=Tiny", "gpu_type=TestGPU")
    # What a writer killed mid-write leaves on a local disk: a hidden, partial temp file.
    store.location.put(
        f"{part}/{TMP_PREFIX}0123456789ab-part-{time.time_ns():020d}-0123456789abcdef-replace.parquet", b"PAR1\x00"
    )
    assert set(store.read(LAYER_PROFILES, {"model": "Tiny"})) == set(rows)
    if store.location.scheme == "s3":
        # On S3 a killed upload is a multipart upload that was never completed: no object at all.
        boto3 = pytest.importorskip("boto3")
        server = request.getfixturevalue("s3_server")
        s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                          aws_secret_access_key=server.secret_key, region_name="us-east-1")
        bucket, _, prefix = part.partition("/")
        key = f"{prefix}/part-{time.time_ns():020d}-feedfeedfeedfeed-replace.parquet"
        up = s3.create_multipart_upload(Bucket=bucket, Key=key)
        s3.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"x" * (5 * 2**20))
    assert set(store.read(LAYER_PROFILES, {"model": "Tiny"})) == set(rows)


_WRITER = textwrap.dedent(
    """
    import dataclasses, sys
    import pyarrow as pa
    import pyarrow.fs as pafs
    from profiles_store import open_store
    from tests.store_fixtures import HeldWrites
    store = open_store(sys.argv[1], seed=False)
    n = 100 * 4 * 100
    base = {"model": ["Big"] * n, "gpu_type": ["TestGPU"] * n, "mbs": [1 + i // 400 for i in range(n)],
            "tp": [1 + (i // 100) % 4 for i in range(n)], "layer": [i % 100 for i in range(n)],
            "backward_s": [0.0] * n, "optimizer_s": [0.0] * n}
    gen = 0
    while True:
        gen += 1
        if gen == 2:  # from the second generation on, uploads stop half way: the kill lands inside one
            held = pafs.PyFileSystem(HeldWrites(store.location.fs))
            store.location = dataclasses.replace(store.location, fs=held)
        table = pa.table({**base, "forward_s": [float(gen)] * n})
        store.write_table("layer_profiles", table, mode="replace", partition={"model": "Big", "gpu_type": "TestGPU"})
        print("committed", gen, flush=True)
    """
)


def test_a_writer_killed_mid_write_leaves_a_whole_generation(store_uri):
    store = empty_store(store_uri)
    store.write(MODELS, [tiny_model("Big", blocks=98, tps=(1,))], provenance=PROV)
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, store_uri], stdout=subprocess.PIPE, text=True, cwd=REPO)
    lines = []
    try:
        while True:  # wait until generation 1 is committed and generation 2 is half uploaded
            line = proc.stdout.readline()
            assert line, f"writer exited early: {lines}"
            lines.append(line.strip())
            if line.startswith("writing") and "committed 1" in lines:
                break  # held half way through an upload until killed
    finally:
        proc.kill()
        proc.wait()
    assert "committed 2" not in lines
    t = store.read_table("layer_profiles", {"model": "Big"})
    assert t.num_rows == 100 * 4 * 100
    assert set(t["forward_s"].to_pylist()) == {1.0}
    # The store stays writable after the crash.
    store.replace_layer_profiles(
        "Big", "TestGPU", profiles(tiny_model("Big", blocks=98, tps=(1,)), "TestGPU", [(1, 1)])
    )
    assert store.read_table("layer_profiles", {"model": "Big"}).num_rows == 100


def test_concurrent_writers_lose_nothing(store_uri):
    stores = [open_store(store_uri, seed=False) for _ in range(2)]
    errors: list[BaseException] = []

    def append(w: int) -> None:
        try:
            for i in range(4):
                stores[w % 2].append_history(
                    "events", [HistoryRecord(run_id="r", kind="k", time=T0, payload={"w": w, "i": i})]
                )
                stores[w % 2].write(EGRESS_PRICES,
                    [EgressPrice(sender_zone=f"w{w}", receiver_zone=f"i{i}", usd_per_gb=0.01)]
                )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=append, args=(w,)) for w in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    got = {(r.payload["w"], r.payload["i"]) for r in stores[0].read_history("events")}
    assert got == {(w, i) for w in range(6) for i in range(4)}
    assert len(stores[1].read(EGRESS_PRICES)) == 24


def test_concurrent_replaces_leave_exactly_one_of_them(store_uri):
    store = empty_store(store_uri)
    model = tiny_model()
    sets = [profiles(model, "TestGPU", [(m, 1)], scale=float(m)) for m in (1, 2, 4, 8)]
    threads = [
        threading.Thread(target=lambda rows=rows: open_store(store_uri, seed=False).replace_layer_profiles(
            "Tiny", "TestGPU", rows, provenance=Provenance(source="t", recorded_at=T0)))
        for rows in sets
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    got = set(store.read(LAYER_PROFILES, {"model": "Tiny"}))
    assert any(got == set(s) for s in sets)


def test_readers_during_replaces_always_see_one_whole_generation(store_uri):
    store = empty_store(store_uri)
    model = tiny_model()
    gens = [profiles(model, "TestGPU", [(1, 1), (2, 1)], scale=float(g)) for g in range(1, 9)]
    store.replace_layer_profiles("Tiny", "TestGPU", gens[0], provenance=PROV)
    seen: list[set] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read() -> None:
        reader = open_store(store_uri, seed=False)
        try:
            while not done.is_set():
                seen.append(set(reader.read(LAYER_PROFILES, {"model": "Tiny"})))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    th = threading.Thread(target=read)
    th.start()
    try:
        for rows in gens[1:]:
            store.replace_layer_profiles("Tiny", "TestGPU", rows, provenance=PROV)
    finally:
        done.set()
        th.join()
    assert not errors
    whole = [set(g) for g in gens]
    assert seen and all(s in whole for s in seen)
