"""Every handler that catches everything says why, so no error disappears unexplained.

A fault that is swallowed where it happens turns into a wrong decision far away (a listing error once
read as "no checkpoint" restarted a job from step 0). The rule, checked over the product's packages:
an `except Exception` / `except BaseException` / bare `except` either raises (the error itself or a
translation of it) or carries a comment on its `except` line saying why going on is safe (most also
log what they caught); a `contextlib.suppress(Exception)` carries such a comment on its line.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sailor_core", "flows", "tasks", "infra", "profiles_store", "sailor_cli")
BROAD = {"Exception", "BaseException"}


def _caught(node: ast.expr | None) -> set[str]:
    if node is None:
        return {"BaseException"}  # a bare except
    if isinstance(node, ast.Tuple):
        return set().union(*(_caught(e) for e in node.elts))
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, ast.Attribute):
        return {node.attr}
    return set()


def _commented_lines(source: str) -> set[int]:
    return {t.start[0] for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}


def unexplained(source: str, name: str = "<source>") -> list[str]:
    """`name:line` of each broad handler that neither raises nor says why it goes on."""
    tree, commented, found = ast.parse(source), _commented_lines(source), []
    for n in ast.walk(tree):
        if isinstance(n, ast.ExceptHandler) and _caught(n.type) & BROAD:
            raises = any(isinstance(x, ast.Raise) for b in n.body for x in ast.walk(b))
            if not raises and n.lineno not in commented:
                found.append(f"{name}:{n.lineno}")
        if isinstance(n, ast.With | ast.AsyncWith):
            for item in n.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and _caught(call.func) & {"suppress"} \
                        and set().union(*(_caught(a) for a in call.args)) & BROAD and call.lineno not in commented:
                    found.append(f"{name}:{call.lineno}")
    return sorted(found, key=lambda x: int(x.rsplit(":", 1)[1]))


def test_the_rule_tells_a_silent_handler_from_an_explained_one():
    silent = "try:\n    f()\nexcept Exception:\n    pass\nwith contextlib.suppress(BaseException):\n    g()\n"
    assert unexplained(silent) == ["<source>:3", "<source>:5"]
    fine = ("try:\n    f()\nexcept Exception as e:\n    raise Other() from e\n"
            "try:\n    f()\nexcept BaseException:  # why\n    pass\n"
            "try:\n    f()\nexcept ValueError:\n    pass\n"
            "with contextlib.suppress(Exception):  # why\n    g()\nwith contextlib.suppress(OSError):\n    g()\n")
    assert unexplained(fine) == []


def test_every_broad_handler_raises_or_says_why():
    found = [x for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
             for x in unexplained(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == [], "broad handlers that neither raise nor say why going on is safe: " + ", ".join(found)
