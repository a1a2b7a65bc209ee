"""Paths the tests share. No side effects on import: a child process that imports a test module (a
spawned worker unpickling a test's function) must not make a temporary folder, as importing
tests/conftest.py does."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE_DATA = REPO.parent / "shared" / "reference_data"
