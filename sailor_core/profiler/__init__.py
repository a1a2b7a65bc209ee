"""The profiler: per-layer time and memory of a model, and network bandwidth between workers.

Contract: measurement functions return domain values and write nothing
(`layers.profile_model`, `network.profile_network`); `save` lands complete results in a store
that the caller passes in. `profile_model_to_store` / `profile_network_to_store` are the entry
points the CLI (`sailor profile model|network`) and the flow's profiling tasks share. Importing
this package does not import torch; the measuring code imports it when it runs.
"""

from sailor_core.profiler.layers import ModelProfile, ModelProfileSettings, profile_model
from sailor_core.profiler.network import NetworkProfile, NetworkSettings, profile_network
from sailor_core.profiler.save import (
    profile_model_to_store,
    profile_network_to_store,
    save_model_profile,
    save_network_profile,
)

__all__ = [
    "ModelProfile",
    "ModelProfileSettings",
    "NetworkProfile",
    "NetworkSettings",
    "profile_model",
    "profile_model_to_store",
    "profile_network",
    "profile_network_to_store",
    "save_model_profile",
    "save_network_profile",
]
