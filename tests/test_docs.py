"""Every path a doc cites exists: links, code paths and cited sections in README.md, docs/*.md and code.

What counts as a citation:
- a markdown link to a local file (`[text](planner.md)`, `[text](docs/x.md#a-section)`): the file
  exists, relative to the page, and the anchor is one of its headings;
- a code path in backticks or plain text: `sailor_core/plan_format.py`, `tests/test_x.py`,
  `sailor_core/runtime/` (from the repository root), `runtime/lr_schedule.py` or `groups.py` (a path
  that ends a file of the repository), `tasks/control.Controller` or `plan_format.py:plan_from_dict`
  (the file exists and defines the name), `sailor_core.planner.search` (a module, or a module's name);
- in the code (docstrings, comments, error messages): `docs/x.md`, `docs/x.md#anchor` and
  `docs/x.md, 'Section'` (the page exists and has the section, as a heading or a bold label).
Backticked names that are data, not repository files (`meta.json`, `zone/name`), are not citations:
a path is one when it ends in `.py` or `.md` or starts with a folder of the repository.
"""

from __future__ import annotations

import ast
import builtins
import fnmatch
import io
import re
import subprocess
import tokenize
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("sailor_core", "profiles_store", "infra", "tasks", "flows", "sailor_cli")
TOP = (*PACKAGES, "tests", "bench", "docs", "scenarios", "mk")
GENERATED = ("build/",)  # folders a command writes (`make wheel`); cited as outputs, not sources
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
TICKED = re.compile(r"`([^`\s]+)`")
PLAIN_PATH = re.compile(r"(?<![\w./:-])((?:" + "|".join(TOP) + r")/[\w./-]*[\w/])")
CALL = re.compile(r"`([A-Za-z_][\w.]*)\([^`]*\)`")
DOC_CITE = re.compile(r"(?<![\w/])docs/([\w-]+\.md)(#[\w-]+)?(?:,\s*'([^']+)')?")


@cache
def repo_files() -> tuple[str, ...]:
    """The repository's files (git's view: tracked and not ignored), else every file under its folders."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        out = [str(p.relative_to(REPO)) for top in TOP if (REPO / top).is_dir() for p in (REPO / top).rglob("*")]
    return tuple(f for f in out if (REPO / f).exists())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@cache
def sections(page: Path) -> tuple[set[str], str]:
    """A page's heading anchors, and its headings and bold labels as one text to search."""
    text = page.read_text()
    heads = [m.group(1) for m in re.finditer(r"^#+\s+(.+)$", text, re.M)]
    bold = re.findall(r"\*\*([^*]+)\*\*", text)
    return {slug(h) for h in heads}, "\n".join(heads + bold).lower()


@cache
def defined_names(path: Path) -> frozenset[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def find_file(path: str) -> str | None:
    """The repository file or folder `path` names: from the root, else the one it ends."""
    path = path.rstrip("/")
    if (REPO / path).exists() and path.split("/")[0] in TOP + ("README.md", "Makefile", "pyproject.toml"):
        return path
    if path.split("/")[0] in TOP:
        return None  # rooted at a folder of the repository: must exist from the root
    for f in repo_files():
        if f == path or f.endswith("/" + path) or ("/" + path + "/") in ("/" + f):
            return f
    return None


def check_code_path(token: str) -> str | None:
    """None when `token` is not a citation or cites something that exists; else what is wrong."""
    token = token.rstrip(".,;")
    if token.startswith(GENERATED) or "://" in token or token.startswith(("/", "~", "$", ".")):
        return None
    if "*" in token and token.split("/")[0] in TOP:
        return None if any(fnmatch.fnmatch(f, token) for f in repo_files()) else f"nothing matches {token}"
    name = None
    m = (re.fullmatch(r"([\w./-]+\.py)::?(\w+)", token)
         or re.fullmatch(r"([\w/]+/\w+)\.([A-Za-z_]\w*)", token))
    if m and m.group(2) not in {"py", "md", "yaml", "yml", "json", "toml", "csv", "txt", "jsonl", "log"}:
        token, name = (m.group(1) if m.group(1).endswith(".py") else m.group(1) + ".py"), m.group(2)
    elif re.fullmatch(r"(" + "|".join(PACKAGES) + r")(\.\w+)+", token):
        return check_module(token)
    is_code = token.endswith((".py", ".md")) or token.split("/")[0] in TOP and "/" in token
    if not is_code or not re.fullmatch(r"[\w./-]+", token):
        return None
    found = find_file(token)
    if found is None:
        return f"{token} does not exist"
    if name and name not in defined_names(REPO / found):
        return f"{found} does not define {name}"
    return None


@cache
def project_names() -> frozenset[str]:
    names: set[str] = set(dir(builtins))
    for package in (*PACKAGES, "bench", "tests"):
        for path in (REPO / package).rglob("*.py"):
            names |= defined_names(path)
    return frozenset(names)


@cache
def class_members() -> dict[str, set[str]]:
    """Class name -> the names its body defines, over every class of the project."""
    out: dict[str, set[str]] = {}
    for package in (*PACKAGES, "bench", "tests"):
        for path in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    members = out.setdefault(node.name, set())
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                            members.add(item.name)
                        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                            members.add(item.target.id)
                        elif isinstance(item, ast.Assign):
                            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return out


def check_call(call: str) -> str | None:
    """A cited call: `plan(request, book)` names something the project defines, `ParallelPlan.violations()`
    a member of that class, `sailor_core.planner.plan(...)` a module's name."""
    parts = call.split(".")
    if parts[0] in PACKAGES:
        return check_module(call)
    if len(parts) == 2 and parts[0] in class_members():
        ok = parts[1] in class_members()[parts[0]]
        return None if ok else f"{call}() is cited but class {parts[0]} defines no {parts[1]}"
    return None if parts[-1] in project_names() else f"{call}() is cited but nothing in the project defines it"


def check_module(dotted: str) -> str | None:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = REPO.joinpath(*parts[:k])
        mod = base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"
        if mod.exists():
            rest = parts[k:]
            if not rest or (len(rest) == 1 and rest[0] in defined_names(mod)):
                return None
            return f"{'.'.join(parts[:k])} does not define {'.'.join(rest)}"
    return f"module {dotted} does not exist"


def check_link(page: Path, target: str) -> str | None:
    if re.match(r"[a-z]+:", target):
        return None  # https:, mailto:
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve() if file else page
    if not dest.exists():
        return f"link to {target}: {file} does not exist"
    if anchor and dest.suffix == ".md" and anchor not in sections(dest)[0]:
        return f"link to {target}: {dest.name} has no heading with anchor #{anchor}"
    return None


def check_doc_cite(page: str, anchor: str | None, section: str | None) -> str | None:
    dest = REPO / "docs" / page
    if not dest.exists():
        return f"docs/{page} does not exist"
    anchors, text = sections(dest)
    if anchor and anchor[1:] not in anchors:
        return f"docs/{page} has no heading with anchor {anchor}"
    if section and section.lower() not in text:
        return f"docs/{page} has no section '{section}'"
    return None


def doc_problems(page: Path) -> list[str]:
    text = page.read_text()
    rel = page.relative_to(REPO) if page.is_relative_to(REPO) else page
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        found = [check_link(page, t) for t in LINK.findall(line)]
        found += [check_code_path(t) for t in TICKED.findall(line)]
        found += [check_call(c) for c in CALL.findall(line)]
        bare = TICKED.sub("", LINK.sub("", line))
        found += [check_code_path(t) for t in PLAIN_PATH.findall(bare)]
        found += [check_doc_cite(*m.groups()) for m in DOC_CITE.finditer(line)]
        out += [f"{rel}:{n}: {p}" for p in found if p]
    return out


def prose_lines(source: str) -> set[int]:
    """Line numbers of a module's comments and docstrings (where it cites files; strings may be data)."""
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            lines.add(tok.start[0])
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return lines


def code_problems(path: Path) -> list[str]:
    """Docs cited anywhere in a module (error messages too); code paths cited in its comments and docstrings."""
    source = path.read_text()
    prose = prose_lines(source)
    out = []
    for n, line in enumerate(source.splitlines(), 1):
        found = [check_doc_cite(*m.groups()) for m in DOC_CITE.finditer(line)]
        if n in prose:
            found += [check_code_path(t) for t in PLAIN_PATH.findall(line) if not t.startswith("docs/")]
        out += [f"{path.relative_to(REPO)}:{n}: {p}" for p in found if p]
    return out


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_doc_cites_exists(page: Path) -> None:
    problems = doc_problems(page)
    assert not problems, "broken citations:\n" + "\n".join(problems)


def test_every_doc_the_code_cites_exists() -> None:
    problems = []
    for package in (*PACKAGES, "bench", "tests"):
        for path in sorted((REPO / package).rglob("*.py")):
            if path != Path(__file__).resolve():  # its own examples are broken on purpose
                problems += code_problems(path)
    assert not problems, "broken citations of docs:\n" + "\n".join(problems)


def test_the_glossary_names_what_the_code_defines() -> None:
    """The glossary (sailor_core's docstring) names classes and members the code has, and the drifts it lists."""
    import sailor_core

    glossary = sailor_core.__doc__ or ""
    assert "Drifts:" in glossary
    problems = []
    for token in TICKED.findall(glossary):
        if re.fullmatch(r"[A-Z][A-Za-z]+(\.[A-Za-z_]\w*)?", token) or re.fullmatch(r"[a-z_]+\([a-z]*\)", token):
            problems.append(check_call(token.split("(")[0]))
    problems += [check_code_path(p) for p in PLAIN_PATH.findall(glossary)]
    assert not [p for p in problems if p], "glossary names what does not exist:\n" + "\n".join(p for p in problems if p)


def test_the_checks_catch_broken_citations(tmp_path: Path) -> None:
    assert check_code_path("sailor_core/plan_format.py") is None
    assert check_code_path("sailor_core/no_such.py") == "sailor_core/no_such.py does not exist"
    assert check_code_path("runtime/lr_schedule.py") is None and check_code_path("groups.py") is None
    assert check_code_path("nope_module.py") == "nope_module.py does not exist"
    assert check_code_path("sailor_core/plan_format.py:plan_from_dict") is None
    assert "does not define" in (check_code_path("sailor_core/plan_format.py:validate") or "")
    assert "does not define" in (check_code_path("tasks/control.NoSuchThing") or "")
    assert check_code_path("sailor_core.plan_format.load_plan_file") is None
    assert check_code_path("sailor_core.nothing_here") == "sailor_core does not define nothing_here"
    assert check_code_path("nothing_here.x") is None  # not a package of the project: not a citation
    assert check_code_path("meta.json") is None and check_code_path("zone/name") is None
    assert check_code_path("tests/test_docs.py::test_the_checks_catch_broken_citations") is None
    assert "does not define" in (check_code_path("tests/test_docs.py::test_nothing") or "")
    assert check_code_path("tests/test_planner*.py") is None
    assert check_code_path("tests/test_nothing*.py") == "nothing matches tests/test_nothing*.py"
    assert check_call("split_batch") is None and check_call("max") is None
    assert check_call("ParallelPlan.validate") == \
        "ParallelPlan.validate() is cited but class ParallelPlan defines no validate"
    assert check_call("ParallelPlan.violations") is None and check_call("sailor_core.planner.plan") is None
    assert check_call("no_such_function") == "no_such_function() is cited but nothing in the project defines it"
    assert CALL.findall("see `ParallelPlan.violations(num_layers)` and `x`") == ["ParallelPlan.violations"]
    assert prose_lines('"""doc\nmore"""\nx = "s"  # note\n') == {1, 2, 3}
    assert check_doc_cite("formats.md", None, "Plan files") is None
    assert check_doc_cite("formats.md", None, "No such part") == "docs/formats.md has no section 'No such part'"
    assert check_doc_cite("nothing.md", None, None) == "docs/nothing.md does not exist"
    page = tmp_path / "p.md"
    page.write_text("# A title\n[x](missing.md) [y](#a-title) [z](#nope) see `tasks/no.py` and bench/none.py\n")
    problems = "\n".join(doc_problems(page))
    assert "missing.md does not exist" in problems and "#nope" in problems and "#a-title" not in problems
    assert "tasks/no.py does not exist" in problems and "bench/none.py does not exist" in problems
    assert check_link(page, "missing.md") == "link to missing.md: missing.md does not exist"
    assert check_link(page, "#a-title") is None
    assert "no heading" in (check_link(page, "#nope") or "")
    assert PLAIN_PATH.findall("see bench/none.py and s3://b/tasks/x") == ["bench/none.py"]
