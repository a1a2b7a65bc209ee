"""`sailor data`: prepare training data.

Contract: `sailor data prepare INPUT... --tokenizer tokenizer.json --out URI [--text-field text]
[--shard-tokens N] [--eos auto|none|TOKEN] [--add-special-tokens] [--json]` tokenizes jsonl / parquet /
text files (local paths or s3:// / gs:// URIs, files or folders) with a Hugging Face tokenizer.json into sharded token
files with an index (sailor_core.runtime.prepare, layout in sailor_core.runtime.token_shards) at
URI; `sailor train --data URI` then streams them. Prints one line per shard and a summary, or the
index as JSON. Bad input is a `SailorError`: one line, exit 2. `--eos auto` with a tokenizer that has
no known end-of-document token prints a warning naming the flag on stderr (the documents run into each other).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from sailor_cli.options import Json

app = typer.Typer(help="Prepare training data: tokenize text into shards in object storage.", no_args_is_help=True)


@app.command("prepare")
def prepare_cmd(
    inputs: Annotated[list[str], typer.Argument(help="jsonl / parquet / text files or folders (local, s3://, gs://)")],
    tokenizer: Annotated[str, typer.Option(
        "--tokenizer", help="Hugging Face tokenizer.json, or the model folder holding it (path or URI)")],
    out: Annotated[str, typer.Option("--out", help="folder or s3:// / gs:// prefix for the shards and index.json")],
    text_field: Annotated[str, typer.Option("--text-field", help="JSON field / Parquet column with the text")] = "text",
    shard_tokens: Annotated[int, typer.Option("--shard-tokens", help="tokens per shard")] = 1 << 24,
    eos: Annotated[str, typer.Option(
        "--eos", help="end-of-document token: auto, none, or a token of the tokenizer")] = "auto",
    add_special_tokens: Annotated[bool, typer.Option("--add-special-tokens", help=(
        "let the tokenizer add its special tokens (e.g. Llama's beginning of text) to each document"))] = False,
    as_json: Json = False,
) -> None:
    """Tokenize INPUTS with TOKENIZER into shards plus index.json at OUT (--json: print the index)."""
    from sailor_core.runtime.prepare import prepare_dataset

    def progress(msg: dict) -> None:
        if msg["kind"] == "warning":
            typer.echo(f"warning: {msg['message']}", err=True)
        elif msg["kind"] == "shard" and not as_json:
            typer.echo(f"wrote {msg['name']}: {msg['tokens']} tokens ({msg['documents']} documents so far)")

    index = prepare_dataset(list(inputs), tokenizer, out, text_field=text_field, shard_tokens=shard_tokens,
                            eos=eos, add_special_tokens=add_special_tokens, progress=progress)
    if as_json:
        typer.echo(json.dumps(index))
        return
    typer.echo(f"prepared {index['documents']} documents, {index['total_tokens']} tokens in {len(index['shards'])} "
               f"shards ({index['dtype']}, vocabulary {index['vocab_size']}) at {out}; train with --data {out}")
