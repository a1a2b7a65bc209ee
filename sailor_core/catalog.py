"""Built-in catalog: known GPU types and the architecture of the models the published data covers.

Contract: pure data. GPU memory and GPUs per node follow the Sailor artifact's cluster config
(basic_cluster_config.json); peak FLOP/s are vendor datasheet dense bf16/fp16 tensor figures.
The store may hold more GPU types; these are the defaults a fresh install knows.
"""

from __future__ import annotations

from sailor_core.domain import GIB, GpuType

GPU_TYPES: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType(name="A100-40", memory_bytes=40 * GIB, gpus_per_node=4, peak_flops=312e12),
        GpuType(name="A100-80", memory_bytes=80 * GIB, gpus_per_node=4, peak_flops=312e12),
        GpuType(name="V100-16", memory_bytes=16 * GIB, gpus_per_node=4, peak_flops=125e12),
        GpuType(name="GH-96", memory_bytes=96 * GIB, gpus_per_node=4, peak_flops=989e12),
        GpuType(name="Titan-RTX", memory_bytes=24 * GIB, gpus_per_node=8, peak_flops=130e12),
        GpuType(name="RTX-2080", memory_bytes=11 * GIB, gpus_per_node=8, peak_flops=80e12),
        GpuType(name="RTX-3090", memory_bytes=24 * GIB, gpus_per_node=8, peak_flops=142e12),
        # The local provider's worker slots: one process per "GPU" on this machine's CPUs.
        GpuType(name="cpu", memory_bytes=8 * GIB, gpus_per_node=4, peak_flops=None),
    )
}

# Architecture of the published models (blocks, hidden, heads, sequence, vocabulary, FFN).
# OPT-350 and GPT-Neo-2.7 from the artifact's training configs; OPT-30 and LLAMA-3-8 from their
# public model cards, with the block count set so that blocks + 2 equals the artifact's layer count.
MODEL_ARCHITECTURES: dict[str, dict[str, int]] = {
    "OPT-350": dict(
        num_blocks=24, hidden_size=1024, num_heads=16, sequence_length=2048, vocab_size=50272, ffn_hidden_size=4096
    ),
    "GPT-Neo-2.7": dict(
        num_blocks=32, hidden_size=2560, num_heads=32, sequence_length=2048, vocab_size=128256, ffn_hidden_size=10240
    ),
    "OPT-30": dict(
        num_blocks=48, hidden_size=7168, num_heads=56, sequence_length=2048, vocab_size=50272, ffn_hidden_size=28672
    ),
    "LLAMA-3-8": dict(
        num_blocks=33, hidden_size=4096, num_heads=32, sequence_length=2048, vocab_size=128256, ffn_hidden_size=14336
    ),
}


def is_cpu_type(gpu_type: str) -> bool:
    """A device type that runs on CPU cores: `cpu`, and the local testbed's `cpu-<speed>` types, which
    stand in for GPU types of different speed (infra/scenario.py)."""
    return gpu_type == "cpu" or gpu_type.startswith("cpu-")
