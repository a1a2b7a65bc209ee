"""Paths the tests share. No side effects on import: a child process that imports a test module (a
spawned worker unpickling a test's function) must not make a temporary folder, as importing
tests/conftest.py does."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The published data the tests need, shipped in the repository (unchanged files from eth-easl/sailor,
# MIT; what and why in tests/data/README-eth-easl-sailor.md). A folder `read_eth_easl` reads.
PUBLISHED_DATA = REPO / "tests" / "data"
# The 15 measured GH200 (clariden) runs of OPT-350: plans with their measured time and memory.
MEASURED_RUNS = PUBLISHED_DATA / "eth-easl-sailor/sailor/Planner/simulations/validation/clariden/OPT-350"
# The whole published tree, beside the repository in the project's workplace only: tests that need
# all of it (rebuilding the seed, importing every pair) skip without it.
REFERENCE_DATA = REPO.parent / "shared" / "reference_data"
