"""Tokenize text into the sharded layout of sailor_core.runtime.token_shards (`sailor data prepare`).

Contract: `prepare_dataset(inputs, tokenizer_uri, out, ...)` reads every input (a file, or every
`.jsonl`/`.json`/`.parquet`/`.txt`/`.md` file under a folder or object-storage prefix, in sorted
path order), one document per JSON line (field `text_field`), per Parquet row (column
`text_field`) or per text file; encodes them in order with a Hugging Face `tokenizer.json`
(`tokenizers` package; a folder or prefix means its tokenizer.json; the tokenizer's own special
tokens, e.g. Llama's beginning-of-text, only with `add_special_tokens`; the end-of-sequence id
appended per document when the tokenizer has one: `eos` "auto" looks for </s>, <|endoftext|>,
<|end_of_text|>, <eos>, and warns (a `progress` message of kind "warning", else Python's warnings)
when it finds none, since the documents then run into each other); and
writes shards of `shard_tokens` tokens, then index.json, to `out` (a folder or s3:// / gs://
prefix). A non-empty `out` (one with an index) is refused, a document without the field is an
error naming the file and line, and nothing is half-visible: readers look at index.json, written
last. Returns the index.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from sailor_core.errors import SailorError
from sailor_core.files import write_atomic
from sailor_core.models.hf_config import read_bytes
from sailor_core.runtime.token_shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX,
    dtype_for,
    open_root,
    read_index,
    shard_name,
)
from sailor_core.uris import redact

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt", ".md")
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
DEFAULT_SHARD_TOKENS = 1 << 24  # 32 MiB of uint16 per shard
ENCODE_BATCH = 256


def _list_inputs(uri: str) -> list[tuple[Any, str, str]]:
    """(filesystem, path, display name) of every input file `uri` names."""
    from pyarrow import fs as pafs

    filesystem, root = open_root(uri)
    info = filesystem.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise SailorError(f"input {redact(uri)!r} does not exist; to fix: check the path or URI")
    if info.type == pafs.FileType.File:
        return [(filesystem, root, redact(uri))]
    found = [i.path for i in filesystem.get_file_info(pafs.FileSelector(root, recursive=True))
             if i.type == pafs.FileType.File and i.path.endswith(SUFFIXES)]
    if not found:
        raise SailorError(f"no {'/'.join(SUFFIXES)} files under {redact(uri)!r}; to fix: point at the text to tokenize")
    return [(filesystem, p, p) for p in sorted(found)]


def _lines(filesystem: Any, path: str) -> Iterator[bytes]:
    with filesystem.open_input_stream(path) as f:
        rest = b""
        while chunk := f.read(8 << 20):
            parts = (rest + chunk).split(b"\n")
            rest = parts.pop()
            yield from parts
        if rest:
            yield rest


def _documents(filesystem: Any, path: str, name: str, text_field: str) -> Iterator[str]:
    if path.endswith((".jsonl", ".json")):
        for n, line in enumerate(_lines(filesystem, path), start=1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:
                raise SailorError(f"{name} line {n}: not JSON ({e}); to fix: one JSON object per line") from None
            if not isinstance(doc, dict) or not isinstance(doc.get(text_field), str):
                raise SailorError(f"{name} line {n}: no string field {text_field!r}; to fix: pass --text-field "
                                  f"with the field that holds the text")
            yield doc[text_field]
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq

        with filesystem.open_input_file(path) as f:
            pf = pq.ParquetFile(f)
            if text_field not in pf.schema_arrow.names:
                raise SailorError(f"{name}: no column {text_field!r} (has {pf.schema_arrow.names}); to fix: "
                                  f"pass --text-field")
            for batch in pf.iter_batches(columns=[text_field]):
                yield from (t for t in batch.column(0).to_pylist() if t is not None)
    else:
        with filesystem.open_input_stream(path) as f:
            yield f.read().decode("utf-8", errors="replace")


def load_tokenizer(uri: str) -> tuple[Any, str]:
    """A tokenizer.json (path or URI, or the folder / prefix of a model holding one) and its digest."""
    from tokenizers import Tokenizer


    base, sep, query = uri.partition("?")
    if not base.endswith(".json"):  # a model's folder: its tokenizer.json
        uri = f"{base.rstrip('/')}/tokenizer.json{sep}{query}"
    raw = read_bytes(uri)
    try:
        return Tokenizer.from_str(raw.decode()), hashlib.sha256(raw).hexdigest()
    except Exception as e:  # noqa: BLE001 - tokenizers raises its own exception type
        raise SailorError(
            f"{uri}: not a Hugging Face tokenizer.json ({e}); to fix: pass the model's tokenizer.json"
        ) from None


def _eos_id(tok: Any, eos: str | None) -> int | None:
    if eos is None or eos == "none":
        return None
    if eos == "auto":
        for cand in EOS_CANDIDATES:
            if (i := tok.token_to_id(cand)) is not None:
                return int(i)
        return None
    i = tok.token_to_id(eos)
    if i is None:
        raise SailorError(f"the tokenizer has no token {eos!r}; to fix: pass --eos with one of its tokens, or none")
    return int(i)


def _warn(progress: Callable[[dict[str, Any]], None] | None, message: str) -> None:
    """A warning to the caller's progress callback (the CLI prints it on stderr), else Python's warnings."""
    if progress is not None:
        progress({"kind": "warning", "message": message})
    else:

        warnings.warn(message, stacklevel=3)


def prepare_dataset(inputs: list[str], tokenizer_uri: str, out: str, *, text_field: str = "text",
                    shard_tokens: int = DEFAULT_SHARD_TOKENS, eos: str | None = "auto",
                    add_special_tokens: bool = False,
                    progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    if shard_tokens < 1:
        raise SailorError(f"shard size must be >= 1 token, got {shard_tokens}")
    if not inputs:
        raise SailorError("no inputs; to fix: name the jsonl / parquet / text files or folders to tokenize")
    tok, tok_sha = load_tokenizer(tokenizer_uri)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    dtype = np.dtype(dtype_for(vocab)).newbyteorder("<")
    eos_id = _eos_id(tok, eos)
    if eos == "auto" and eos_id is None:
        _warn(progress, f"the tokenizer has none of {', '.join(EOS_CANDIDATES)}: documents are joined with no "
                        f"end-of-document token between them; to fix: pass --eos with the tokenizer's end-of-document "
                        f"token, or --eos none to join them so on purpose")
    filesystem, root = open_root(out)
    if read_index(filesystem, root) is not None:
        raise SailorError(f"{redact(out)!r} already holds a prepared dataset; to fix: choose another --out")
    from pyarrow import fs as pafs

    if not isinstance(filesystem, pafs.S3FileSystem | pafs.GcsFileSystem):
        filesystem.create_dir(root, recursive=True)
    files = [x for uri in inputs for x in _list_inputs(uri)]
    shards: list[dict[str, Any]] = []
    pending: list[np.ndarray] = []
    pending_n = 0
    docs = 0

    def flush(final: bool) -> None:
        nonlocal pending, pending_n
        while pending_n >= shard_tokens or (final and pending_n):
            flat = np.concatenate(pending)
            take, rest = flat[:shard_tokens], flat[shard_tokens:]
            data = take.astype(dtype).tobytes()
            name = shard_name(len(shards))
            _put(filesystem, root, name, data)
            shards.append({"name": name, "tokens": int(len(take)), "sha256": hashlib.sha256(data).hexdigest()})
            if progress:
                progress({"kind": "shard", "name": name, "tokens": int(len(take)), "documents": docs})
            pending, pending_n = ([rest] if len(rest) else []), int(len(rest))

    def encode(texts: list[str]) -> None:
        nonlocal pending_n
        for enc in tok.encode_batch(texts, add_special_tokens=add_special_tokens):
            ids = np.asarray(enc.ids + ([eos_id] if eos_id is not None else []), dtype=np.int64)
            pending.append(ids)
            pending_n += len(ids)
        flush(final=False)

    for fs_, path, name in files:
        batch: list[str] = []
        for text in _documents(fs_, path, name, text_field):
            batch.append(text)
            docs += 1
            if len(batch) == ENCODE_BATCH:
                encode(batch)
                batch = []
        if batch:
            encode(batch)
        if progress:
            progress({"kind": "file", "name": name, "documents": docs})
    flush(final=True)
    if not shards:
        raise SailorError(f"the inputs hold no text to tokenize ({docs} documents); to fix: check the inputs")
    index = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "dtype": dtype_for(vocab), "vocab_size": vocab,
             "eos_id": eos_id, "total_tokens": sum(s["tokens"] for s in shards), "documents": docs,
             "tokenizer_sha256": tok_sha, "sources": [n for _, _, n in files], "text_field": text_field,
             "add_special_tokens": add_special_tokens,
             "shards": shards}
    _put(filesystem, root, INDEX, json.dumps(index, indent=1).encode())
    return index


def _put(filesystem: Any, root: str, name: str, data: bytes) -> None:
    """One file of the dataset. A local one is a regular file or a new path, written atomically (a device, a
    folder or a symbolic link at that name is refused: sailor_core/files.py); object storage has none of those."""
    from pyarrow import fs as pafs

    if isinstance(filesystem, pafs.LocalFileSystem):

        write_atomic("--out", f"{root}/{name}", data)
        return
    with filesystem.open_output_stream(f"{root}/{name}") as f:
        f.write(data)
