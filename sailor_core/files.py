"""Files a user names: input read within stated bounds, outputs written without harm to what is there.

Contract (stdlib only; `yaml` imported lazily by `parse_yaml`):

Reading. Every file Sailor parses may be hostile (a binary, `/dev/zero`, a YAML alias bomb, JSON
nested 200,000 deep, `1e400`, a name with a newline). Each loader (pool files, plan files, traces,
scenario files) reads through these helpers with its own stated limits (docs/formats.md, "Limits"),
so that any input either loads or raises the loader's error class with one line, in bounded time and
memory:
- `read_text(path, max_bytes=..., what=..., error=...)` reads at most `max_bytes` (a longer file,
  a device that never ends, is refused without reading further) and refuses what is not UTF-8 text
  or holds a NUL byte (a binary file).
- `parse_json(text, ...)` refuses NaN, Infinity, numbers that overflow a float (`1e400`), integers
  of more than `MAX_INT_DIGITS` digits, duplicate keys in an object and nesting deeper than the
  parser's recursion guard (Python's recursion limit, about 1,000 levels).
- `parse_yaml(text, ...)` does the same for YAML (`.inf`/`.nan` included; nesting deeper than
  `MAX_DEPTH`, checked on the parser's events before anything is built) and refuses aliases
  (`*name`): a 540-byte file of nested aliases expands to billions of nodes, and no file of ours
  needs one. The C parser (libyaml) is used where PyYAML has it.
- `shown(value)` is the bounded form of a value for a message (never more than `SHOWN_CHARS`
  characters, whatever the value holds); `check_name(value, where, errors)` accepts a name (zone,
  region, cloud, GPU type) of at most `MAX_NAME_CHARS` printable characters.
Writing. `check_output_file(flag, path, error=...)` accepts a regular file or a new path and
refuses anything else (a folder, a device such as /dev/full, a FIFO, a socket, a symbolic link);
`write_atomic(flag, path, data)` checks the same, writes a temporary file of a unique name beside
it and renames it over the path, so readers see the old or the new content, and parallel writers
never share a temporary file (`mode=0o600` for a file that holds a secret: it never exists with
wider permissions).

Folders a run trusts. `private_dir(path, what=..., error=...)` is a folder only this user may enter,
for what a process of this user (often root) later reads back and acts on (records of processes to
kill, scripts it runs, a run's secret): created 0700 where missing; where it exists it must be this
user's own, a folder and not a symbolic link, and writable by nobody else (it is then set to 0700);
and no folder on the way to it may be another user's or writable by others without the sticky bit
(whoever can rename a folder on the way can swap what lies under it). A folder that fails is refused
with one line, never used.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import reprlib
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from sailor_core.errors import SailorError

MAX_DEPTH = 32  # nesting of lists and mappings; the deepest of our formats needs 6
MAX_INT_DIGITS = 18  # a whole number of up to 10^18: more than any count, step or size we read
MAX_NAME_CHARS = 64  # a zone, region, cloud or GPU type name
SHOWN_CHARS = 60  # the most characters of a value a message shows

ErrorType = Callable[[str], SailorError]


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """`repr(value)` for a message, bounded: at most `limit` characters, nested values cut short."""
    r = reprlib.Repr()
    r.maxlevel, r.maxdict, r.maxlist, r.maxtuple, r.maxset = 2, 4, 4, 4, 4
    r.maxstring = r.maxother = r.maxlong = limit
    text = r.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def shown_text(text: str, limit: int = SHOWN_CHARS) -> str:
    """`text` for a one-line message: control characters escaped, cut to `limit` characters."""
    if not text.isprintable():
        text = text.encode("unicode_escape").decode("ascii")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def shown_path(path: str | os.PathLike[str]) -> str:
    """A path for a one-line message (`shown_text`, up to 300 characters)."""
    return shown_text(os.fspath(path), 300)


def check_name(value: Any, where: str, errors: list[str]) -> str | None:
    """`value` as a name (a string or a whole number), or None with the problem added to `errors`."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        errors.append(f"{where}: a name must be text, got {shown(value)}")
        return None
    name = str(value)
    if not name or len(name) > MAX_NAME_CHARS:
        errors.append(f"{where}: a name has 1 to {MAX_NAME_CHARS} characters, got {len(name)}: {shown(name)}")
        return None
    if not name.isprintable() or name != name.strip():
        errors.append(f"{where}: name {shown(name)} holds control characters (a newline, a tab) or leading or "
                      f"trailing blanks; to fix: use letters, digits, '-' and '_'")
        return None
    return name


# --- reading -----------------------------------------------------------------------------------------------------
def read_text(path: str | os.PathLike[str], *, max_bytes: int, what: str, error: ErrorType) -> str:
    """The file's text, read within `max_bytes` (see the contract); every problem is `error(one line)`."""
    p = shown_path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{what} {p} does not exist; to fix: check the path") from None
    except IsADirectoryError:
        raise error(f"{what} {p} is a folder; to fix: name the file in it") from None
    except PermissionError:
        raise error(f"{what} {p} is not readable (permission denied); to fix: check its permissions") from None
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror or e}; to fix: check the path") from None
    if len(data) > max_bytes:
        raise error(f"{what} {p} is larger than {max_bytes:,} bytes, the most Sailor reads as one; to fix: "
                    f"check the path (a device or a binary?), or split the file (limits: docs/formats.md)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what} {p} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}: a binary "
                    f"file?); to fix: name the YAML or JSON file") from None
    if "\0" in text:
        raise error(f"{what} {p} holds a NUL byte at offset {text.index(chr(0))} (a binary file?); to fix: name "
                    f"the YAML or JSON file")
    return text


class _Refused(SailorError):
    """Raised inside a parser's hooks; the caller turns it into the loader's error class."""


def _finite(s: str) -> float:
    x = float(s)
    if x == math.inf or x == -math.inf:
        raise _Refused(f"the number {shown_text(s)} is too large for a float")
    return x


def _whole(s: str) -> int:
    if len(s) > MAX_INT_DIGITS and len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"a whole number of {len(s.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(s)


def _no_constant(s: str) -> NoReturn:
    raise _Refused(f"{s} is not a number Sailor accepts (NaN and infinities are refused)")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):  # rare: find the key for the message
        seen: set[str] = set()
        key = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise _Refused(f"key {shown(key)} appears twice in one object (the second would silently win)")
    return out


def parse_json(text: str, *, source: str, error: ErrorType) -> Any:
    """JSON within the bounds of the contract; every problem is `error(one line)` naming `source`."""

    try:
        data = json.loads(text, parse_float=_finite, parse_int=_whole, parse_constant=_no_constant,
                          object_pairs_hook=_unique_keys)
    except _Refused as e:
        raise error(f"{source}: {e}; to fix: correct the file") from None
    except RecursionError:  # the C parser's own guard, at Python's recursion limit (about 1,000 levels)
        raise error(f"{source} nests lists or objects too deeply; to fix: correct the file") from None
    except json.JSONDecodeError as e:
        raise error(f"{source} is not valid JSON: {e}; to fix: correct it there") from None
    except ValueError as e:  # e.g. a number json itself cannot convert
        raise error(f"{source} is not valid JSON: {shown_text(str(e), 120)}; to fix: correct it there") from None
    return data


def parse_yaml(text: str, *, source: str, error: ErrorType) -> Any:
    """YAML within the bounds of the contract (no aliases); every problem is `error(one line)`."""
    import yaml

    loader_base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        _check_events(yaml.parse(text, Loader=loader_base), source)
        return yaml.load(text, Loader=_strict_loader(loader_base))  # noqa: S506 - a SafeLoader subclass
    except _Refused as e:
        raise error(f"{source}: {e}; to fix: correct the file") from None
    except yaml.YAMLError as e:
        raise error(f"{source} is not valid YAML: {yaml_problem(e)}; to fix: correct it there") from None
    except (ValueError, OverflowError, RecursionError) as e:  # a scalar PyYAML's constructors cannot convert
        raise error(f"{source} is not valid YAML: {shown_text(str(e), 120)}; to fix: correct it there") from None


def yaml_problem(e: Exception) -> str:
    """PyYAML's multi-line message as one bounded line: where, then what."""
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + shown_text(" ".join(str(getattr(e, "problem", None) or e).split()), 200)


def _check_events(events: Any, source: str) -> None:
    """Refuse aliases and deep nesting from the parser's events, before anything is built."""
    import yaml

    depth = 0
    for ev in events:
        if isinstance(ev, yaml.AliasEvent):
            line = ev.start_mark.line + 1 if ev.start_mark is not None else "?"
            raise _Refused(f"line {line}: YAML aliases (*{shown_text(ev.anchor or '', 30)}) are not accepted "
                           f"(write the value out)")
        if isinstance(ev, yaml.SequenceStartEvent | yaml.MappingStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise _Refused(f"lists or mappings nest deeper than {MAX_DEPTH} levels")
        elif isinstance(ev, yaml.SequenceEndEvent | yaml.MappingEndEvent):
            depth -= 1


@functools.cache
def _strict_loader(base: type) -> type:
    """`base` (a SafeLoader) refusing duplicate keys, non-finite floats and overlong whole numbers."""
    import yaml

    class Strict(base):  # type: ignore[misc]
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, list | dict):
                    raise _Refused(f"line {key_node.start_mark.line + 1}: a key must be a name")
                if key in seen:
                    raise _Refused(f"line {key_node.start_mark.line + 1}: key {shown(key)} appears twice in one "
                                   f"mapping (the second would silently win)")
                seen.add(key)
            return dict(super().construct_mapping(node, deep=deep))

    def whole(loader: Any, node: Any) -> int:
        value = str(node.value).replace("_", "")
        if len(value.lstrip("-+")) > MAX_INT_DIGITS:
            raise _Refused(f"line {node.start_mark.line + 1}: a whole number of more than {MAX_INT_DIGITS} digits")
        return int(yaml.SafeLoader.construct_yaml_int(loader, node))

    def real(loader: Any, node: Any) -> float:
        x = float(yaml.SafeLoader.construct_yaml_float(loader, node))
        if not math.isfinite(x):
            raise _Refused(f"line {node.start_mark.line + 1}: {shown(node.value)} is not a finite number")
        return x

    Strict.add_constructor("tag:yaml.org,2002:int", whole)
    Strict.add_constructor("tag:yaml.org,2002:float", real)
    return Strict


# --- writing -----------------------------------------------------------------------------------------------------
def check_output_files(*outputs: tuple[str, str | os.PathLike[str] | None]) -> None:
    """`check_output_file` for each (flag, path) given a path: a command's outputs, before any work."""
    for flag, path in outputs:
        if path:
            check_output_file(flag, path)


def check_output_file(flag: str, path: str | os.PathLike[str], *, error: ErrorType = SailorError) -> None:
    """`path` is a regular file or a new path in an existing folder (see the contract); else `error`."""
    p = shown_path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = Path(os.path.abspath(path)).parent
        if not parent.is_dir():
            raise error(f"{flag} {p}: folder {shown_path(parent)} does not exist; to fix: create it, or name a file "
                        f"in an existing folder") from None
        return
    except OSError as e:
        raise error(f"{flag} {p}: {e.strerror or e}; to fix: name a file you may write") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{flag} {p} is {_kind(st.st_mode)}, not a regular file; to fix: name a new file or a regular "
                    f"file to replace")


def _kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")]
    return next((name for test, name in kinds if test(mode)), "not a file")


def umask() -> int:
    """This process's umask (read, not changed: setting it to read it races with other threads)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def write_atomic(flag: str, path: str | os.PathLike[str], data: bytes, *, error: ErrorType = SailorError,
                 mode: int | None = None) -> None:
    """Write `data` to `path` through a uniquely named temporary file beside it (see the contract); `mode`:
    the file's permissions (default: what a new file gets under the umask)."""
    check_output_file(flag, path, error=error)
    target = os.path.abspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=f".{os.path.basename(target)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o666 & ~umask() if mode is None else mode)
        check_output_file(flag, path, error=error)  # still a regular file or absent: only then replace it
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# --- folders a run trusts ----------------------------------------------------------------------------------------
def private_dir(path: str | os.PathLike[str], *, what: str, error: ErrorType = SailorError) -> Path:
    """`path` as a folder only this user may enter (see the contract); returns it."""
    p = Path(os.path.abspath(path))
    me = os.geteuid()
    _check_ancestors(p.parent, what, error)
    for folder in [*reversed([q for q in p.parents if not q.exists()]), p]:
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise error(f"cannot create {what} {shown_path(folder)}: {e.strerror or e}; to fix: name a folder you "
                        f"may create") from None
    st = os.lstat(p)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise error(f"{what} {shown_path(p)} is {_kind(st.st_mode)}, not a folder of its own; to fix: remove it, or "
                    f"name another folder")
    if st.st_uid != me or _open_to_others(st):
        owner = f"user {st.st_uid}" if st.st_uid != me else "you, but writable by others"
        raise error(f"{what} {shown_path(p)} belongs to {owner} (mode {stat.S_IMODE(st.st_mode):04o}): whoever "
                    f"controls it controls what this run reads back and runs; to fix: remove it, or name a folder "
                    f"of your own")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(p, 0o700)
    return p


def _open_to_others(st: os.stat_result) -> bool:
    """Writable by another user: by everyone, or by a group that is not this process's own."""
    return bool(st.st_mode & 0o002 or (st.st_mode & 0o020 and st.st_gid != os.getegid()))


def _check_ancestors(folder: Path, what: str, error: ErrorType) -> None:
    """No folder on the way to `what` is another user's (root's excepted) or writable by others unless sticky."""
    me = os.geteuid()
    for q in [folder, *folder.parents]:
        try:
            st = os.stat(q)
        except FileNotFoundError:
            continue
        if st.st_uid not in (0, me) or (_open_to_others(st) and not st.st_mode & stat.S_ISVTX):
            raise error(f"{what} lies under {shown_path(q)}, which user {st.st_uid} owns with mode "
                        f"{stat.S_IMODE(st.st_mode):04o}: another user could swap what is under it; to fix: name a "
                        f"folder under one only you and root may change")
