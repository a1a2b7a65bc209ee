"""No function outside tests is longer than 80 lines (issue 15: a function does one job).

A function's length runs from its `def` line to its last line (decorators excluded, its docstring,
comments, blank lines and nested functions included), as Python's ast reports them. Every function
and method counts, nested ones too, in every package outside tests: sailor_core, profiles_store,
tasks, flows, infra, sailor_cli and bench. A function that grows past the limit is split along the
jobs it mixes (STYLE.md: "Functions that do one job").
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("sailor_core", "profiles_store", "tasks", "flows", "infra", "sailor_cli", "bench")
MAX_LINES = 80


def function_lengths(source: str, filename: str = "<source>") -> list[tuple[str, int, int]]:
    """(qualified name, line of the def, lines from def to end) of every function in `source`."""
    out: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                assert child.end_lineno is not None
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename=filename), "")
    return out


def python_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        assert (REPO / package).is_dir(), f"{package}/ is missing: update PACKAGES"
        files += sorted(p for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts)
    return files


def test_the_measure_counts_from_def_to_the_last_line_nested_and_methods_included():
    body = "\n".join(f"    x{i} = {i}" for i in range(79))  # def line + 79 = 80 lines: allowed
    src = (
        f"def ok():\n{body}\n\n"
        f"def too_long():\n{body}\n    return 1\n\n"  # 81 lines
        "class C:\n    @staticmethod\n    def m():\n"
        "        def inner():\n            return 2\n        return inner\n"
    )
    got = {name: (line, n) for name, line, n in function_lengths(src)}
    assert got["ok"] == (1, 80)
    assert got["too_long"][1] == 81
    assert got["C.m"][1] == 4 and got["C.m.inner"][1] == 2  # the decorator line is not counted


def test_no_function_outside_tests_is_longer_than_80_lines():
    files = python_files()
    assert len(files) > 50  # the walk found the packages
    too_long = []
    for path in files:
        for name, line, n in function_lengths(path.read_text(), str(path)):
            if n > MAX_LINES:
                too_long.append((n, f"{path.relative_to(REPO)}:{line} {name} ({n} lines)"))
    assert not too_long, (
        f"{len(too_long)} function(s) longer than {MAX_LINES} lines; to fix: split each along the jobs it mixes:\n"
        + "\n".join(text for _, text in sorted(too_long, reverse=True))
    )
