"""No fixed sleep stands for an event in the tests: every `time.sleep` in tests/ is inside a polling
loop with a deadline (a `while` or `for` loop that reads the clock or a deadline), as tests/waits.py's
`wait_for` is. A sleep that stands alone waits for something it does not check, and under load that
something comes later (the suite's history of flaky tests under load is mostly such sleeps)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCK = ("monotonic", "deadline", "time.time()", "perf_counter")


def fixed_sleeps(source: str) -> list[int]:
    """Lines of `time.sleep` / `sleep` calls not inside a loop that reads the clock or a deadline."""
    tree = ast.parse(source)
    parent = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}
    bad = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) in ("time.sleep", "sleep")):
            continue
        up, polled = node, False
        while up in parent and not polled:
            up = parent[up]
            polled = isinstance(up, (ast.While, ast.For)) and any(c in ast.unparse(up) for c in CLOCK)
        if not polled:
            bad.append(node.lineno)
    return bad


def test_every_sleep_in_the_tests_is_a_polling_wait_with_a_deadline() -> None:
    found = [f"{p.relative_to(TESTS.parent)}:{line}" for p in sorted(TESTS.rglob("*.py"))
             for line in fixed_sleeps(p.read_text())]
    assert not found, ("fixed sleeps in the tests; to fix: wait for the event they stand for "
                       "(tests/waits.py wait_for, with a deadline):\n" + "\n".join(found))


def test_the_check_tells_a_fixed_sleep_from_a_polling_wait() -> None:
    assert fixed_sleeps("import time\ntime.sleep(7)\n") == [2]
    assert fixed_sleeps("import time\nfor _ in range(3):\n    time.sleep(1)\n") == [3]
    polled = ("import time\nend = time.monotonic() + 5\n"
              "while not done() and time.monotonic() < end:\n    time.sleep(0.1)\n")
    assert fixed_sleeps(polled) == []
