"""Byte-level token datasets with a deterministic sample order by global sample index.

Contract:
- `load_tokens(uri)` reads a corpus as a flat uint8/uint16/int32 token array: a `.npy` file of
  token ids, or text (one file, or every text file of a directory in sorted path order, read as
  bytes: the byte-level tokenizer is the identity on bytes, vocabulary 256). `uri` is a local path,
  `file://...`, or an object-storage URI (`s3://`, `gs://`) read with pyarrow's filesystems.
  `default_corpus()` is the Python standard library's own sources, present on any machine with
  Python, so the default dataset needs no download.
- `TokenDataset(tokens, seq_len, seed).sample(g)` is sample number `g` of the run: a window of
  `seq_len + 1` tokens whose start is a pure function of (seed, g). The runtime numbers samples
  globally (samples seen before this step + position in the global batch), so any plan, and a plan
  change mid-run, sees the same samples in the same order: none skipped, none repeated.
- `TokenBatches` is what the trainer reads: TokenDataset, or token_shards.ShardedTokenDataset.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from sailor_core.errors import SailorError

DEFAULT_CORPUS_BYTES = 8 * 2**20  # enough distinct windows for any test run, read in ~0.1 s
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".json", ".csv", ".html", ".xml", ".c", ".h", "")


def default_corpus() -> str:
    """The directory of the running Python's standard library sources."""
    return sysconfig.get_paths()["stdlib"]


def _read_uri_bytes(uri: str, limit: int) -> bytes:
    from pyarrow import fs as pafs  # lazily: only object storage needs it

    try:
        filesystem, path = pafs.FileSystem.from_uri(uri)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad URI
        raise SailorError(f"cannot open dataset {uri!r}: {e}; to fix: check the URI and credentials") from None
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise SailorError(f"dataset {uri!r} does not exist; to fix: check the URI")
    paths = [path]
    if info.type == pafs.FileType.Directory:
        sel = pafs.FileSelector(path, recursive=True)
        paths = sorted(i.path for i in filesystem.get_file_info(sel) if i.type == pafs.FileType.File)
    out = bytearray()
    for p in paths:
        with filesystem.open_input_stream(p) as f:
            out += f.read()
        if len(out) >= limit:
            break
    return bytes(out[:limit])


def _read_local_bytes(path: Path, limit: int) -> bytes:
    if path.is_file():
        with open(path, "rb") as f:
            return f.read(limit)
    if not path.is_dir():
        raise SailorError(
            f"dataset path {str(path)!r} does not exist; to fix: pass --data with an existing file or directory"
        )
    out = bytearray()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        # skip caches and binary artefacts so the corpus is the same text on every machine
        dirs[:] = [d for d in dirs if d not in ("__pycache__", "site-packages", ".git")]
        for name in sorted(files):
            if os.path.splitext(name)[1] not in TEXT_SUFFIXES:
                continue
            try:
                with open(os.path.join(root, name), "rb") as f:
                    out += f.read()
            except OSError:
                continue
            if len(out) >= limit:
                return bytes(out[:limit])
    return bytes(out)


def load_tokens(uri: str | None = None, limit_bytes: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """The corpus as a flat token array (see module contract)."""
    uri = uri or default_corpus()
    if uri.endswith(".npy") and "://" not in uri:
        if not os.path.exists(uri):
            raise SailorError(f"dataset {uri!r} does not exist; to fix: check the path")
        arr = np.load(uri, mmap_mode="r")
        return np.asarray(arr).reshape(-1)
    if "://" in uri and not uri.startswith("file://"):
        raw = _read_uri_bytes(uri, limit_bytes)
    else:
        raw = _read_local_bytes(Path(uri.removeprefix("file://")), limit_bytes)
    return np.frombuffer(raw, dtype=np.uint8)


class TokenBatches(Protocol):
    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of samples first .. first+count-1, each [count, seq_len]."""
        ...


class TokenDataset:
    """Windows of `seq_len + 1` tokens; sample g starts at a (seed, g)-determined offset."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int = 0, vocab_size: int = 256):
        if len(tokens) < seq_len + 2:
            raise SailorError(
                f"dataset has {len(tokens)} tokens, fewer than one sample of {seq_len + 1}; to fix: use a larger corpus"
            )
        top = int(tokens.max()) if len(tokens) else 0
        if top >= vocab_size:
            raise SailorError(f"dataset has token id {top} but the model's vocabulary is {vocab_size}")
        # keep bytes as bytes (8x less memory per worker than int64); widen per sample
        dtype = np.uint8 if tokens.dtype == np.uint8 else np.int32
        self.tokens = torch.from_numpy(np.array(tokens, dtype=dtype))  # a writable copy
        self.seq_len = seq_len
        self.seed = seed
        self.num_windows = len(tokens) - seq_len - 1
        self.digest = hashlib.sha256(np.ascontiguousarray(tokens[: 1 << 20]).tobytes()).hexdigest()[:16]

    def _start(self, g: int) -> int:
        h = hashlib.blake2b(f"{self.seed}/{g}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") % self.num_windows

    def sample(self, g: int) -> torch.Tensor:
        s = self._start(g)
        return self.tokens[s : s + self.seq_len + 1].long()

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of samples first .. first+count-1, each [count, seq_len]."""
        w = torch.stack([self.sample(first + i) for i in range(count)])
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()
