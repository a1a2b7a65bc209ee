"""`sailor data prepare` and streamed, sharded datasets: tokenizer.json and fixtures made here.

The S3 cases run against the local S3 server (rclone serve s3) of tests/store_fixtures.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from sailor_core.errors import SailorError
from sailor_core.runtime.token_shards import ShardedTokenDataset, is_prepared, permute
from tests.store_fixtures import BUCKET, gcs_server, s3_server  # noqa: F401 - the session's servers

WORDS = ("the model trains on shards streamed from object storage while the planner picks gpus "
         "and every worker reads only the windows it needs in one global order across plan changes").split()


def documents(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(documents(), trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "</s>"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


def expected_stream(tokenizer_json: str, docs: list[str]) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_json)
    eos = tok.token_to_id("</s>")
    return np.concatenate([np.array(e.ids + [eos]) for e in tok.encode_batch(docs, add_special_tokens=False)])


def test_feistel_permutation_is_a_bijection():
    for n in (1, 2, 7, 64, 1000):
        assert sorted(permute(i, n, "k") for i in range(n)) == list(range(n))
    assert [permute(i, 1000, "a") for i in range(10)] != [permute(i, 1000, "b") for i in range(10)]


def test_prepare_local_parquet_and_text(tmp_path, tokenizer_json):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sailor_core.runtime.prepare import prepare_dataset

    docs = documents(40, seed=1)
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"body": docs[:30]}), str(tmp_path / "in" / "a.parquet"))
    for i, d in enumerate(docs[30:]):
        (tmp_path / "in" / f"b{i:02d}.txt").write_text(d)
    model_dir = str(Path(tokenizer_json).parent)  # a model's folder holding tokenizer.json
    index = prepare_dataset([str(tmp_path / "in")], model_dir, str(tmp_path / "out"), text_field="body",
                            shard_tokens=300)
    want = expected_stream(tokenizer_json, docs)
    assert index["documents"] == 40 and index["total_tokens"] == len(want) and index["dtype"] == "uint16"
    got = np.concatenate([np.fromfile(tmp_path / "out" / s["name"], dtype="<u2") for s in index["shards"]])
    assert np.array_equal(got, want)
    assert all(s["tokens"] == 300 for s in index["shards"][:-1])
    with pytest.raises(SailorError, match="already holds a prepared dataset"):
        prepare_dataset([str(tmp_path / "in")], tokenizer_json, str(tmp_path / "out"), text_field="body")
    with pytest.raises(SailorError, match="no column 'text'.*--text-field"):
        prepare_dataset([str(tmp_path / "in" / "a.parquet")], tokenizer_json, str(tmp_path / "out2"))


@pytest.mark.s3
def test_prepare_jsonl_on_s3_then_stream_only_the_needed_windows(s3_server, tokenizer_json, capsys):  # noqa: F811
    from sailor_cli.main import main

    docs = documents()
    fs = s3_server.filesystem()
    with fs.open_output_stream(f"{BUCKET}/raw/docs.jsonl") as f:
        f.write("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)).encode())
    out = s3_server.uri(BUCKET, "prepared/a")
    rc = main(["data", "prepare", s3_server.uri(BUCKET, "raw/docs.jsonl"), "--tokenizer", tokenizer_json,
               "--out", out, "--shard-tokens", "1000", "--json"])
    assert rc == 0
    index = json.loads(capsys.readouterr().out)
    want = expected_stream(tokenizer_json, docs)
    assert index["total_tokens"] == len(want) and len(index["shards"]) == -(-len(want) // 1000) > 3
    assert is_prepared(out)

    seq = 32
    ds = ShardedTokenDataset(out, seq, seed=0, vocab_size=256)
    n = ds.num_windows
    assert n == (len(want) - 1) // seq
    # one epoch is every window once; a sample is exactly its window of the token stream
    assert sorted(ds.window(g) for g in range(n)) == list(range(n))
    w = ds.window(5)
    assert np.array_equal(ds.sample(5).numpy(), want[w * seq: w * seq + seq + 1])
    assert ds.window(n + 5) != w or n < 2  # a new epoch, a new order
    # streaming: a batch reads its windows' bytes and nothing else
    before = ds.bytes_read
    x, y = ds.batch(10, 4)
    assert ds.bytes_read - before == 4 * (seq + 1) * 2 < len(want) * 2 // 10
    assert x.shape == (4, seq) and np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())
    # reading ahead (as training workers do) gives the same samples
    ahead = ShardedTokenDataset(out, seq, seed=0, vocab_size=256, prefetch=2)
    for first in (0, 4, 8, 2):
        assert all(np.array_equal(a.numpy(), b.numpy()) for a, b in zip(ahead.batch(first, 4), ds.batch(first, 4),
                                                                          strict=True))
    with pytest.raises(SailorError, match=r"vocabulary of \d+ but the model has 50") as err:
        ShardedTokenDataset(out, seq, vocab_size=50)
    assert "sailor-secret" not in str(err.value)


def _llama():
    from sailor_core.models.hf_config import config_from_hf

    return config_from_hf({"model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "vocab_size": 256, "max_position_embeddings": 32}, name="tiny-llama-data")


@pytest.mark.s3
def test_training_streams_the_shards_and_a_plan_change_keeps_the_sample_order(s3_server, tokenizer_json, tmp_path):  # noqa: F811
    from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage
    from sailor_core.runtime.engine import TrainSettings
    from sailor_core.runtime.launcher import run_local
    from sailor_core.runtime.prepare import prepare_dataset

    fs = s3_server.filesystem()
    with fs.open_output_stream(f"{BUCKET}/raw2/docs.jsonl") as f:
        f.write("\n".join(json.dumps({"text": d}) for d in documents(seed=2)).encode())
    data = s3_server.uri(BUCKET, "prepared/train")
    prepare_dataset([s3_server.uri(BUCKET, "raw2/docs.jsonl")], tokenizer_json, data, shard_tokens=2000)
    cfg = _llama()

    def plan(stages):
        return ParallelPlan(model=cfg.name, global_batch_size=4,
                            stages=tuple(Stage(first_layer=a, last_layer=b,
                                               replicas=(Replica(gpu_type="cpu", zone="local", tp=t, gpus_per_node=2),))
                                         for a, b, t in stages),
                            pipelines=(PipelineBatch(microbatch_size=2, num_microbatches=2),))

    def run(p, name, steps, **kw):
        out = tmp_path / f"{name}.jsonl"
        settings = TrainSettings(model=cfg.name, model_config=cfg.to_dict(), steps=steps, data=data,
                                 metrics_out=str(out), timeout_s=60, lr=3e-3, **kw)
        run_local(p, cfg, settings, run_dir=str(tmp_path / f"run-{name}"))
        return {r["step"]: r for r in map(json.loads, out.read_text().splitlines())}

    one = run(plan([(0, 3, 1)]), "one", 6)
    ckpt = str(tmp_path / "ckpt")
    first = run(plan([(0, 1, 1), (2, 3, 1)]), "a", 3, checkpoint_uri=ckpt)
    second = run(plan([(0, 3, 2)]), "b", 6, checkpoint_uri=ckpt, resume=True)
    changed = {**first, **second}
    assert sorted(changed) == list(range(1, 7)) and sorted(second) == [4, 5, 6]
    # the global sample numbering carried over the plan change: samples 0..23, each once, in order
    assert [changed[s]["samples_seen"] for s in range(1, 7)] == [4 * s for s in range(1, 7)]
    for s in range(1, 7):
        assert abs(changed[s]["loss"] - one[s]["loss"]) <= 1e-3 * one[s]["loss"], (
            s,
            changed[s]["loss"],
            one[s]["loss"],
        )
    assert one[6]["loss"] < one[1]["loss"]


@pytest.mark.gcp
def test_prepare_to_gcs_and_stream(gcs_server, tokenizer_json, tmp_path):  # noqa: F811
    from sailor_core.runtime.prepare import prepare_dataset

    docs = documents(50, seed=3)
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    out = gcs_server.uri(BUCKET, "prepared/gcs")
    index = prepare_dataset([str(tmp_path / "d.jsonl")], tokenizer_json, out, shard_tokens=500)
    want = expected_stream(tokenizer_json, docs)
    ds = ShardedTokenDataset(out, 16, seed=1, vocab_size=256)
    assert index["total_tokens"] == len(want) and len(index["shards"]) > 1
    w = ds.window(7)
    assert np.array_equal(ds.sample(7).numpy(), want[w * 16: w * 16 + 17])


def test_special_tokens_only_when_asked(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from sailor_core.runtime.prepare import prepare_dataset

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "d.txt").write_text("a b a")
    for flag, want in ((False, [3, 4, 3, 2]), (True, [1, 3, 4, 3, 2])):
        out = tmp_path / f"out{flag}"
        prepare_dataset([str(tmp_path / "d.txt")], str(tmp_path / "tokenizer.json"), str(out), add_special_tokens=flag)
        assert np.fromfile(out / "shard_00000.bin", dtype="<u2").tolist() == want
