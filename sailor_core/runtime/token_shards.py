"""Tokenized datasets as shards in object storage, streamed by the workers that need them.

Contract (the layout `sailor data prepare` writes under a folder or object-storage prefix ROOT):
- `ROOT/shard_NNNNN.bin`: token ids, little-endian `uint16` (vocabularies up to 65536) or `uint32`,
  documents concatenated in source order, each followed by the end-of-sequence id when the
  tokenizer has one.
- `ROOT/index.json`: {"format": "sailor-tokens", "version": 1, "dtype", "vocab_size", "eos_id",
  "total_tokens", "documents", "tokenizer_sha256", "sources", "shards": [{"name", "tokens",
  "sha256"}]}. It is written last: a dataset without it is incomplete and is not read.
- `ShardedTokenDataset(root, seq_len, seed, vocab_size)` has TokenDataset's interface. The token
  stream is cut into windows of `seq_len + 1` tokens with stride `seq_len` (every token is a
  target once per epoch); sample g is window `permute(g mod n)` of epoch `g // n`, where `permute`
  is a seeded bijection of [0, n) per epoch (a Feistel network with cycle walking), so any plan,
  and a plan change mid-run, sees every window once per epoch in the same order: none skipped,
  none repeated. A sample is read with ranged reads of exactly its bytes from the shards it spans
  (`bytes_read` counts them), so no worker copies the corpus. `batch` reads its samples
  concurrently and, with `prefetch` > 0, starts reading the next `prefetch` batches' samples in the
  background (object-storage latency overlaps training; the samples are the same either way).
- `open_dataset(uri, seq_len, seed, vocab_size)` opens a prepared dataset when `uri` holds an
  index.json, else the byte-level corpus of sailor_core.runtime.data (the demo's default).
  `check_dataset(uri, seq_len, vocab_size)` makes the same checks from the index alone, so
  `sailor train` refuses a dataset tokenized for a larger vocabulary before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sailor_core.errors import SailorError
from sailor_core.uris import filesystem_for, redact

FORMAT_NAME = "sailor-tokens"
FORMAT_VERSION = 1
INDEX = "index.json"
FEISTEL_ROUNDS = 4
READ_THREADS = 8  # concurrent ranged reads per worker


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.bin"


def dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def open_root(uri: str) -> tuple[Any, str]:
    """(pyarrow filesystem, root path) of a folder or an object-storage prefix."""
    return filesystem_for(uri)


def read_index(filesystem: Any, root: str) -> dict[str, Any] | None:
    from pyarrow import fs as pafs

    path = f"{root}/{INDEX}"
    if filesystem.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(path) as f:
        index = json.loads(f.read())
    if index.get("format") != FORMAT_NAME or index.get("version") != FORMAT_VERSION:
        raise SailorError(f"{root}/{INDEX} is not a sailor-tokens v{FORMAT_VERSION} index; to fix: prepare the "
                          f"dataset again with `sailor data prepare`")
    return dict(index)


def permute(i: int, n: int, key: str) -> int:
    """A seeded bijection of [0, n): a balanced Feistel network over the next even bit width, with
    cycle walking back into [0, n)."""
    if n <= 1:
        return 0
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for r in range(FEISTEL_ROUNDS):
            h = hashlib.blake2b(f"{key}/{r}/{right}".encode(), digest_size=8).digest()
            left, right = right, left ^ (int.from_bytes(h, "little") & mask)
        x = (left << half) | right
        if x < n:
            return x


@dataclass(frozen=True)
class _Shard:
    name: str
    start: int  # first token's position in the whole stream
    tokens: int


class ShardedTokenDataset:
    """Windows of a prepared dataset, read on demand from its shards (see module contract)."""

    def __init__(self, uri: str, seq_len: int, seed: int = 0, vocab_size: int | None = None, prefetch: int = 0):
        self.filesystem, self.root = open_root(uri)
        index = read_index(self.filesystem, self.root)
        uri = redact(uri)  # for messages
        if index is None:
            raise SailorError(f"{uri!r} has no {INDEX}; to fix: run `sailor data prepare ... --out {uri}` first")
        self.index = index
        if vocab_size is not None and int(index["vocab_size"]) > vocab_size:
            raise SailorError(
                f"dataset {uri!r} was tokenized with a vocabulary of {index['vocab_size']} but the model has "
                f"{vocab_size}; to fix: use the model's tokenizer (or a model with a larger vocab_size)"
            )
        self.dtype = np.dtype(index["dtype"]).newbyteorder("<")
        self.seq_len, self.seed = seq_len, seed
        self.shards: list[_Shard] = []
        pos = 0
        for s in index["shards"]:
            self.shards.append(_Shard(s["name"], pos, int(s["tokens"])))
            pos += int(s["tokens"])
        self.total_tokens = pos
        self.num_windows = (self.total_tokens - 1) // seq_len
        if self.num_windows < 1:
            raise SailorError(f"dataset {uri!r} has {self.total_tokens} tokens, fewer than one sample of "
                              f"{seq_len + 1}; to fix: prepare more text or train a shorter sequence")
        self.digest = hashlib.sha256(json.dumps(index["shards"], sort_keys=True).encode()).hexdigest()[:16]
        self.bytes_read = 0
        self._files: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.prefetch = prefetch
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future[torch.Tensor]] = {}

    def window(self, g: int) -> int:
        epoch, i = divmod(g, self.num_windows)
        return permute(i, self.num_windows, f"{self.seed}/{epoch}/{self.digest}")

    def _read(self, start: int, count: int) -> np.ndarray:
        """Tokens [start, start + count) of the stream, by ranged reads of the shards they lie in."""
        out = np.empty(count, dtype=self.dtype)
        got = 0
        for sh in self.shards:
            if got == count:
                break
            lo = start + got
            if not sh.start <= lo < sh.start + sh.tokens:
                continue
            n = min(count - got, sh.start + sh.tokens - lo)
            with self._lock:
                f = self._files.get(sh.name)
                if f is None:
                    f = self._files[sh.name] = self.filesystem.open_input_file(f"{self.root}/{sh.name}")
            raw = f.read_at(n * self.dtype.itemsize, (lo - sh.start) * self.dtype.itemsize)  # thread-safe
            with self._lock:
                self.bytes_read += len(raw)
            out[got:got + n] = np.frombuffer(raw, dtype=self.dtype)
            got += n
        if got != count:
            raise SailorError(f"dataset {self.root}: tokens {start}..{start + count} are past its end")
        return out

    def sample(self, g: int) -> torch.Tensor:
        w = self.window(g)
        return torch.from_numpy(self._read(w * self.seq_len, self.seq_len + 1).astype(np.int64))

    def _future(self, g: int) -> Future[torch.Tensor]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="sailor-shards")
        fut = self._ahead.pop(g, None)
        return fut if fut is not None else self._pool.submit(self.sample, g)

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of samples first .. first+count-1, each [count, seq_len]."""
        futures = [self._future(first + i) for i in range(count)]
        for g in range(first + count, first + count * (1 + self.prefetch)):
            if g not in self._ahead:
                self._ahead[g] = self._future(g)
        # a plan change or a re-run step asks for other samples: drop read-ahead it will not use
        for g in [g for g in self._ahead if g < first]:
            del self._ahead[g]
        w = torch.stack([f.result() for f in futures])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()


def is_prepared(uri: str | None) -> bool:
    if not uri:
        return False
    try:
        filesystem, root = open_root(uri)
        return read_index(filesystem, root) is not None
    except SailorError:
        return False
    except OSError:
        return False


def check_dataset(uri: str | None, seq_len: int, vocab_size: int) -> None:
    """Refuse, before any worker starts, a prepared dataset no worker could train on (a tokenizer
    vocabulary larger than the model's, fewer tokens than one sample): only its index is read."""
    if is_prepared(uri):
        assert uri is not None
        ShardedTokenDataset(uri, seq_len, 0, vocab_size)


DEFAULT_PREFETCH = 2  # batches read ahead by a training worker


def open_dataset(uri: str | None, seq_len: int, seed: int = 0, vocab_size: int = 256) -> Any:
    """A prepared (sharded, tokenized) dataset if `uri` holds one, else the byte-level corpus."""
    if is_prepared(uri):
        assert uri is not None
        return ShardedTokenDataset(uri, seq_len, seed, vocab_size, prefetch=DEFAULT_PREFETCH)
    from sailor_core.runtime.data import TokenDataset, load_tokens

    return TokenDataset(load_tokens(uri), seq_len, seed, vocab_size)
