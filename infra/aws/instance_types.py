"""AWS GPU instance types: GPU type and count per VM, vCPUs, and the quota class they count against.

Contract: pure data and lookups. Families p3, p3dn, p4d, p4de, p5, p5e, g5, g6 and g6e. GPU names
follow the project's `model-memoryGB` convention. CPU instances serve GPU type `cpu`, one worker slot per 8
vCPUs (c5/c6i/c7i.2xlarge one, c7i.4xlarge two), for smoke runs of the whole system. Quota codes are the
Service Quotas codes of the vCPU limits each class counts against (on-demand and spot), as AWS documents them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sailor_core.domain import Market


@dataclass(frozen=True, kw_only=True)
class InstanceShape:
    instance_type: str
    gpu_type: str
    gpus: int
    vcpus: int
    quota_class: str  # "P", "G" or "standard"


def _shapes() -> dict[str, InstanceShape]:
    rows = [
        # p3: V100 16 GB; p3dn: V100 32 GB
        ("p3.2xlarge", "V100-16", 1, 8), ("p3.8xlarge", "V100-16", 4, 32), ("p3.16xlarge", "V100-16", 8, 64),
        ("p3dn.24xlarge", "V100-32", 8, 96),
        ("p4d.24xlarge", "A100-40", 8, 96), ("p4de.24xlarge", "A100-80", 8, 96),
        ("p5.4xlarge", "H100-80", 1, 16), ("p5.48xlarge", "H100-80", 8, 192), ("p5e.48xlarge", "H200-141", 8, 192),
        ("g5.xlarge", "A10G-24", 1, 4), ("g5.2xlarge", "A10G-24", 1, 8), ("g5.4xlarge", "A10G-24", 1, 16),
        ("g5.8xlarge", "A10G-24", 1, 32), ("g5.16xlarge", "A10G-24", 1, 64), ("g5.12xlarge", "A10G-24", 4, 48),
        ("g5.24xlarge", "A10G-24", 4, 96), ("g5.48xlarge", "A10G-24", 8, 192),
        ("g6.xlarge", "L4-24", 1, 4), ("g6.2xlarge", "L4-24", 1, 8), ("g6.4xlarge", "L4-24", 1, 16),
        ("g6.8xlarge", "L4-24", 1, 32), ("g6.16xlarge", "L4-24", 1, 64), ("g6.12xlarge", "L4-24", 4, 48),
        ("g6.24xlarge", "L4-24", 4, 96), ("g6.48xlarge", "L4-24", 8, 192),
        ("g6e.xlarge", "L40S-48", 1, 4), ("g6e.12xlarge", "L40S-48", 4, 48), ("g6e.48xlarge", "L40S-48", 8, 192),
    ]
    out = {t: InstanceShape(instance_type=t, gpu_type=g, gpus=n, vcpus=v, quota_class=t[0].upper())
           for t, g, n, v in rows}
    # CPU VMs for GPU type "cpu": one worker slot ("device") per 8 vCPUs, for smoke runs of the whole
    # system on cheap instances; the 16-vCPU ones are multi-device VMs (two ranks, or one tp=2 replica).
    for t, v, n in (("c7i.2xlarge", 8, 1), ("c6i.2xlarge", 8, 1), ("c5.2xlarge", 8, 1), ("c7i.4xlarge", 16, 2)):
        out[t] = InstanceShape(instance_type=t, gpu_type="cpu", gpus=n, vcpus=v, quota_class="standard")
    return out


SHAPES: dict[str, InstanceShape] = _shapes()

# Service Quotas codes (service "ec2"): vCPU limits per instance class and market.
QUOTA_CODES: dict[tuple[str, Market], str] = {
    ("P", Market.ON_DEMAND): "L-417A185B",  # Running On-Demand P instances
    ("G", Market.ON_DEMAND): "L-DB2E81BA",  # Running On-Demand G and VT instances
    ("P", Market.SPOT): "L-7212CCBC",  # All P Spot Instance Requests
    ("G", Market.SPOT): "L-3819A6DF",  # All G and VT Spot Instance Requests
    ("standard", Market.ON_DEMAND): "L-1216C47A",  # Running On-Demand Standard (A, C, D, H, I, M, R, T, Z)
    ("standard", Market.SPOT): "L-34B43A08",  # All Standard (A, C, D, H, I, M, R, T, Z) Spot Instance Requests
}
