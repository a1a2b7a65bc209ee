"""The Parquet profile store: versioned table schemas, backends chosen by URI, the shipped seed.

    from profiles_store import open_store
    store = open_store()                      # $SAILOR_STORE, else ./.sailor/store, over the seed
    book = store.profile_book("OPT-350", ["A100-40", "V100-16"])

Layout, write semantics and the seed are described in store.py and docs/store.md; the tables in
schemas.py. profiles_store depends on sailor_core, never the other way round.
"""

from profiles_store.schemas import SCHEMA_VERSION, TABLES
from profiles_store.store import (
    HistoryRecord,
    PairSummary,
    ProfileStore,
    open_store,
)
from sailor_core.errors import StoreError, UnknownGpuTypeError, UnknownModelError

__all__ = [
    "SCHEMA_VERSION",
    "TABLES",
    "HistoryRecord",
    "PairSummary",
    "ProfileStore",
    "StoreError",
    "UnknownGpuTypeError",
    "UnknownModelError",
    "open_store",
]
