"""Where an export of weights goes: a new folder, or an earlier export replaced as a unit.

Contract: an export (`sailor train --export`, `sailor convert`) is `model.safetensors` or its shards
`model-0000k-of-0000n.safetensors` with `model.safetensors.index.json`, and `config.json`. Written
into a folder that already held an export, the files of the two must never mix: an older index left
beside a new single file made `sailor convert` and transformers follow the index to the older shards
and load the old weights without a word.

- `check_export_target(flag, out)` accepts a new folder or prefix, an empty one, or one that holds
  only an export's files; anything else there (a file that is not an export's, a symbolic link for
  the folder) is refused before the export (and before training) starts.
- `export_writer(flag, out)` is a context manager yielding `write(name, data)`. On a local path the
  files go into a new temporary folder beside `out`, which replaces `out` once every file is written
  (the earlier export is renamed aside, then removed): a reader finds the old export, the new one or,
  for an instant, none, never a mix; on failure `out` is as it was. On object storage (no renames
  there) the new files are written, then every export file of the prefix that this export did not
  write (an older index, older shards) is deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from sailor_core.errors import SailorError
from sailor_core.files import shown, umask
from sailor_core.uris import filesystem_for, redact

EXPORT_NAME = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|config\.json)$")


def _is_local(out: str) -> bool:
    return "://" not in out or out.startswith("file://")


def _names(out: str) -> list[str]:
    """What lies directly in folder or prefix `out` (files and folders; [] when it does not exist)."""
    if _is_local(out):
        path = out.removeprefix("file://")
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    from pyarrow import fs as pafs


    filesystem, root = filesystem_for(out)
    infos = filesystem.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    return sorted(i.base_name for i in infos)


def check_export_target(flag: str, out: str) -> None:
    """Refuse a target an export cannot replace as a unit (see the contract)."""

    if _is_local(out):
        path = out.removeprefix("file://")
        if os.path.islink(path):
            raise SailorError(f"{flag} {path} is a symbolic link; to fix: name the folder itself (an export replaces "
                              f"it as a whole)")
        if os.path.lexists(path) and not os.path.isdir(path):
            raise SailorError(f"{flag} {path} is a file, not a folder; to fix: name a new folder")
    others = [n for n in _names(out) if not EXPORT_NAME.match(n)]
    if others:
        raise SailorError(f"{flag} {redact(out)} holds {len(others)} entr{'y' if len(others) == 1 else 'ies'} that "
                          f"an export does not write (e.g. {shown(others[0])}), which replacing it would lose; to fix: "
                          f"name a new folder, or one that holds only an earlier export")


@contextlib.contextmanager
def export_writer(flag: str, out: str) -> Iterator[Callable[[str, bytes], None]]:
    """`write(name, data)` for the files of one export into `out` (see the contract)."""
    check_export_target(flag, out)
    if not _is_local(out):
        yield from _remote_writer(out)
        return
    target = os.path.abspath(out.removeprefix("file://"))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(target)}.export-")
    try:

        def write(name: str, data: bytes) -> None:
            with open(os.path.join(staging, name), "xb") as f:
                f.write(data)

        yield write
        os.chmod(staging, 0o777 & ~umask())  # mkdtemp's 0700 -> what a new folder gets
        _swap_in(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _swap_in(staging: str, target: str) -> None:
    """`staging` becomes `target`; an earlier `target` is renamed aside first and removed after."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        return
    aside = f"{target}.replaced-{secrets.token_hex(4)}"
    os.rename(target, aside)
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _remote_writer(out: str) -> Iterator[Callable[[str, bytes], None]]:

    filesystem, prefix = filesystem_for(out)
    prefix = prefix.rstrip("/")
    written: set[str] = set()

    def write(name: str, data: bytes) -> None:
        with filesystem.open_output_stream(f"{prefix}/{name}") as f:
            f.write(data)
        written.add(name)

    yield write
    for name in _names(out):
        if EXPORT_NAME.match(name) and name not in written:  # an older export's index or shards
            _delete(filesystem, f"{prefix}/{name}")


def _delete(filesystem: Any, path: str) -> None:
    """Delete one object. pyarrow's S3 delete then PUTs a "parent/" marker, which some S3-compatible servers
    (rclone) refuse while the folder holds objects: the delete itself happened, so check that instead."""
    from pyarrow import fs as pafs

    try:
        filesystem.delete_file(path)
    except OSError as e:
        if "When creating key" not in str(e) or filesystem.get_file_info(path).type != pafs.FileType.NotFound:
            raise
