"""Suite-wide settings: isolate Prefect and the store from the user's home, keep torch to one thread.

Set before any test module imports Prefect or torch. Fixtures specific to one area live in
that area's test modules (or tests/*_fixtures.py), not here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

_TMP = Path(tempfile.mkdtemp(prefix="sailor-tests-"))
# Forced, not defaulted: the Makefile exports PREFECT_HOME for `make run`, and the suite's pytest processes
# (pytest-xdist) must not share one Prefect database.
os.environ["PREFECT_HOME"] = str(_TMP / "prefect")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("SAILOR_STORE", str(_TMP / "store"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("AWS_REQUEST_CHECKSUM_CALCULATION", "when_required")
os.environ.setdefault("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")



def pytest_unconfigure(config) -> None:  # noqa: ANN001 - pytest's hook signature
    """The suite's Prefect home and default store go with the pytest process that made them (again after a
    moment when a server still shutting down wrote into it meanwhile: empty folders were left otherwise)."""
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        shutil.rmtree(_TMP, ignore_errors=True)
        if not _TMP.exists():
            return
        time.sleep(0.1)
