"""GCE GPU VM shapes: accelerator-optimised machine types and N1 hosts with attached GPUs.

Contract: pure data. A shape is a machine type plus its GPUs (built in for a2/a3/g2; attached as
guestAccelerators for N1). Its `instance_type` names both, e.g. `a2-highgpu-4g` or
`n1-standard-16+nvidia-tesla-v100:2`. `quota_metric` is the regional quota that limits the
GPUs (the PREEMPTIBLE_ variant applies to spot VMs). CPU shapes serve GPU type `cpu`, one worker
slot per 8 vCPUs (n2-standard-8 one, n2-standard-16 two), limited by their family's vCPU quota.
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor_core.domain import Market

ACCELERATORS: dict[str, tuple[str, str]] = {
    # accelerator type -> (project GPU name, quota metric)
    "nvidia-tesla-a100": ("A100-40", "NVIDIA_A100_GPUS"),
    "nvidia-a100-80gb": ("A100-80", "NVIDIA_A100_80GB_GPUS"),
    "nvidia-h100-80gb": ("H100-80", "NVIDIA_H100_GPUS"),
    "nvidia-l4": ("L4-24", "NVIDIA_L4_GPUS"),
    "nvidia-tesla-v100": ("V100-16", "NVIDIA_V100_GPUS"),
    "nvidia-tesla-t4": ("T4-16", "NVIDIA_T4_GPUS"),
}


@dataclass(frozen=True, kw_only=True)
class GceShape:
    machine_type: str
    accelerator: str
    gpus: int
    vcpus: int
    memory_gib: float
    attached: bool  # True: N1 host + guestAccelerators; False: GPUs built into the machine type

    @property
    def cpu_only(self) -> bool:
        return not self.accelerator

    @property
    def instance_type(self) -> str:
        return f"{self.machine_type}+{self.accelerator}:{self.gpus}" if self.attached else self.machine_type

    @property
    def gpu_type(self) -> str:
        return ACCELERATORS[self.accelerator][0] if self.accelerator else "cpu"

    @property
    def family(self) -> str:
        return self.machine_type.split("-", 1)[0]

    def quota_metric(self, market: Market) -> str:
        """The regional quota: GPUs of the accelerator, or for a CPU shape its family's vCPUs."""
        if self.cpu_only:
            return f"{self.family.upper()}_CPUS"
        metric = ACCELERATORS[self.accelerator][1]
        return f"PREEMPTIBLE_{metric}" if market is Market.SPOT else metric


def _shapes() -> list[GceShape]:
    out = []
    for n, v, m in ((1, 12, 85), (2, 24, 170), (4, 48, 340), (8, 96, 680)):
        out.append(GceShape(machine_type=f"a2-highgpu-{n}g", accelerator="nvidia-tesla-a100", gpus=n, vcpus=v,
                            memory_gib=m, attached=False))
        out.append(GceShape(machine_type=f"a2-ultragpu-{n}g", accelerator="nvidia-a100-80gb", gpus=n, vcpus=v,
                            memory_gib=2 * m, attached=False))
    out.append(GceShape(machine_type="a2-megagpu-16g", accelerator="nvidia-tesla-a100", gpus=16, vcpus=96,
                        memory_gib=1360, attached=False))
    out.append(GceShape(machine_type="a3-highgpu-8g", accelerator="nvidia-h100-80gb", gpus=8, vcpus=208,
                        memory_gib=1872, attached=False))
    for v, n in ((4, 1), (8, 1), (12, 1), (16, 1), (32, 1), (24, 2), (48, 4), (96, 8)):
        out.append(GceShape(machine_type=f"g2-standard-{v}", accelerator="nvidia-l4", gpus=n, vcpus=v,
                            memory_gib=4 * v, attached=False))
    for acc, counts in (("nvidia-tesla-v100", (1, 2, 4, 8)), ("nvidia-tesla-t4", (1, 2, 4))):
        for n in counts:
            v = 8 * n
            out.append(GceShape(machine_type=f"n1-standard-{v}", accelerator=acc, gpus=n, vcpus=v,
                                memory_gib=3.75 * v, attached=True))
    # CPU VMs for GPU type "cpu": one worker slot ("device") per 8 vCPUs, for smoke runs of the whole system;
    # n2-standard-16 is a multi-device VM (two ranks, or one tp=2 replica).
    for v, n in ((8, 1), (16, 2)):
        out.append(GceShape(machine_type=f"n2-standard-{v}", accelerator="", gpus=n, vcpus=v, memory_gib=4 * v,
                            attached=False))
    return out


SHAPES: dict[str, GceShape] = {s.instance_type: s for s in _shapes()}

