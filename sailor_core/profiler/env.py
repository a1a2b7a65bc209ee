"""What the profiler records about where it ran, and the GPU-type name it labels results with.

Contract: `provenance(tool, device, settings)` builds a `Provenance` whose `settings` is a JSON
object holding the caller's settings plus the host, device name, torch and Python versions, so a
stored profile says exactly how it was measured. `default_gpu_type(device)` maps the device at
hand to the store's GPU-type names (the artifact's `A100-40`, `GH-96`, ...; `cpu` on the CPU).
"""

from __future__ import annotations

import json
import platform
import socket
from datetime import UTC, datetime
from typing import Any

from sailor_core.catalog import GPU_TYPES
from sailor_core.domain import GpuType, Provenance
from sailor_core.errors import SailorError

# CUDA device-name fragments -> the store's GPU-type names (artifact naming: type-memoryGB).
_CUDA_NAMES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("GH200",), "GH-96"),
    (("A100", "80GB"), "A100-80"),
    (("A100",), "A100-40"),
    (("V100",), "V100-16"),
    (("TITAN RTX",), "Titan-RTX"),
    (("2080",), "RTX-2080"),
    (("3090",), "RTX-3090"),
    (("H200",), "H200"),
    (("H100",), "H100"),
)


def device_name(device: str) -> str:
    if device == "cpu":
        return platform.processor() or platform.machine() or "cpu"
    import torch

    return torch.cuda.get_device_name(0)


def default_gpu_type(device: str) -> str:
    """The GPU-type label for results measured on `device` ('cpu' or 'cuda')."""
    if device == "cpu":
        return "cpu"
    name = device_name(device)
    for parts, label in _CUDA_NAMES:
        if all(p.lower() in name.lower() for p in parts):
            return label
    return name.replace("NVIDIA ", "").replace(" ", "-")


def check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise SailorError(f"unknown device {device!r}; to fix: use --device cpu or --device cuda")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SailorError("--device cuda was asked for but torch sees no CUDA GPU here; to fix: use --device cpu")


def provenance(tool: str, device: str, settings: dict[str, Any]) -> Provenance:
    import torch

    info = dict(settings)
    info.update(
        host=socket.gethostname(),
        device=device,
        device_name=device_name(device),
        torch=torch.__version__,
        python=platform.python_version(),
    )
    return Provenance(
        source=tool, host=socket.gethostname(), recorded_at=datetime.now(UTC), settings=json.dumps(info, sort_keys=True)
    )


def device_gpu_type(device: str, name: str) -> GpuType:
    """The `GpuType` of the device at hand, for a store that does not know `name` yet."""

    if name in GPU_TYPES:
        return GPU_TYPES[name]
    if device == "cpu":
        return GpuType(
            name=name, memory_bytes=GPU_TYPES["cpu"].memory_bytes, gpus_per_node=GPU_TYPES["cpu"].gpus_per_node
        )
    import torch

    return GpuType(
        name=name,
        memory_bytes=int(torch.cuda.get_device_properties(0).total_memory),
        gpus_per_node=max(1, torch.cuda.device_count()),
    )
