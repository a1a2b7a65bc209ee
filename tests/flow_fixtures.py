"""Fixtures for flow tests: one Prefect test server per session, and a store with gpt-tiny's cpu profile.

Load them in a test module with `pytest_plugins = ["tests.flow_fixtures"]` (one instance per session).
The store is profiled once per session by the real `profile` subflow (sailor_core.profiler on this
machine's CPU, about 30 s), so every flow test plans from measured numbers.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            yield


@pytest.fixture(scope="session")
def profiled_store(prefect_harness, tmp_path_factory):
    from flows.profiling import profile
    from profiles_store.store import open_store

    uri = str(tmp_path_factory.mktemp("flow-store") / "store")
    store = open_store(uri)
    book = profile(store, "gpt-tiny", ["cpu"], mbs=[1, 2])
    assert book.profiled_points("cpu"), "the profile subflow wrote no cpu profile"
    return uri
