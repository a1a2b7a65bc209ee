"""Sharded-dataset benchmark on the local S3 server (rclone serve s3), measured side by side in one run.

1. `sailor data prepare` throughput: a jsonl of 8000 documents on S3 -> uint16 shards on S3 (a
   word-level tokenizer.json made here, so tokenization itself is cheap: this is the I/O path).
2. Data wait per batch of 8 samples of 1025 tokens while a 10 ms "step" runs between batches,
   without read-ahead (the batch's samples read concurrently when asked) and with the training
   workers' read-ahead of 2 batches; the ratio is the latency read-ahead hides.
3. One ranged read of one sample, sequentially.

    python bench/bench_data.py
"""

from __future__ import annotations

import atexit
import json
import random
import shutil
import tempfile
import time

from profiles_store.local_servers import LocalS3Server
from sailor_core.runtime.prepare import prepare_dataset
from sailor_core.runtime.token_shards import ShardedTokenDataset

STEP_S = 0.01  # the compute a real step would overlap with read-ahead
BATCHES = 50


def main() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    rng = random.Random(0)
    words = [f"w{i}" for i in range(3000)]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(100, 400))) for _ in range(8000)]
    tmp = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)  # the tokenizer goes with the bench
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "</s>", *words])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(f"{tmp}/tokenizer.json")
    with LocalS3Server() as s3:
        s3.create_bucket("bench")
        with s3.filesystem().open_output_stream("bench/raw/docs.jsonl") as f:
            f.write("\n".join(json.dumps({"text": d}) for d in docs).encode())
        t0 = time.perf_counter()
        idx = prepare_dataset([s3.uri("bench", "raw/docs.jsonl")], f"{tmp}/tokenizer.json", s3.uri("bench", "tok"),
                              shard_tokens=1 << 18)
        dt = time.perf_counter() - t0
        print(f"prepare: {idx['documents']} docs, {idx['total_tokens']} tokens, {len(idx['shards'])} shards in "
              f"{dt:.2f} s ({idx['total_tokens'] / dt / 1e6:.2f} M tokens/s)")
        waits = {}
        for prefetch in (0, 2):
            ds = ShardedTokenDataset(s3.uri("bench", "tok"), 1024, 0, 4096, prefetch=prefetch)
            ds.batch(0, 8)
            t0 = time.perf_counter()
            for k in range(1, BATCHES + 1):
                ds.batch(8 * k, 8)
                time.sleep(STEP_S)
            waits[prefetch] = (time.perf_counter() - t0 - STEP_S * BATCHES) / BATCHES
            print(
                f"read-ahead {prefetch} batches: data wait {waits[prefetch] * 1e3:.2f} ms per batch of 8 x 1025 tokens"
            )
        print(f"ratio (wait with read-ahead / without): {waits[2] / waits[0]:.2f}")
        ds = ShardedTokenDataset(s3.uri("bench", "tok"), 1024, 0, 4096)
        t0 = time.perf_counter()
        for g in range(200):
            ds.sample(g)
        print(f"one ranged read: {(time.perf_counter() - t0) / 200 * 1e3:.2f} ms per sample")


if __name__ == "__main__":
    main()
