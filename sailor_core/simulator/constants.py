"""Named constants of the simulator, each with its unit and where it comes from.

Contract: pure data. Nothing here is fitted to the measured validation runs; every value is a
framework default, a datasheet/format fact or a property of the algorithms the runtime uses.
docs/simulator.md explains how each enters the model.
"""

from __future__ import annotations

# --- numeric formats ------------------------------------------------------------------------
# Bytes per element. Source: IEEE 754 binary32 / bfloat16.
FP32_BYTES = 4
BF16_BYTES = 2

# The published activation sizes (llm_info.json `act_mem_bytes`) were measured in the precision the
# profiler ran in, fp32 (params_bytes = 4 x params_floats). A bf16 run keeps the same tensors in
# half the bytes, except softmax/loss statistics; we scale the stored bytes by this ratio.
# Source: the format (README, section 1) and the dtype size ratio.
BF16_ACTIVATION_SCALE = BF16_BYTES / FP32_BYTES

# --- model state per parameter (bytes), by precision, Adam(W) -----------------------------------
# fp32: weights 4 + gradients 4 + Adam first and second moments 4 + 4.
# Source: the ZeRO paper (Rajbhandari et al., SC'20), section 3.1, K=8 for fp32 Adam.
FP32_WEIGHT_BYTES = 4
FP32_GRAD_BYTES = 4
FP32_ADAM_STATE_BYTES = 8
# bf16 mixed precision: bf16 weights 2 + bf16 gradients 2 + fp32 master weights 4 + moments 8
# (ZeRO paper's "2 + 2 + K" with K = 12).
BF16_WEIGHT_BYTES = 2
BF16_GRAD_BYTES = 2
BF16_MASTER_AND_ADAM_BYTES = 12

# --- the optimizer step's temporaries ---------------------------------------------------------
# The runtime steps with torch.optim.AdamW, which on a GPU takes its multi-tensor (foreach) path: it
# allocates sqrt(exp_avg_sq) for every parameter it steps (`torch._foreach_sqrt`, one fp32 tensor per
# parameter, the rest of the update works in place) and frees it when the step ends. By then the
# activations are freed, so it adds to the peak only beyond them. Source: torch/optim/adam.py
# (_multi_tensor_adam). The artifact's runs (DeepSpeed) are not charged: their optimizer's
# implementation is not in the published data.
ADAM_STEP_TEMPORARY_BYTES_PER_PARAM = 4

# --- data-parallel gradient reduction ----------------------------------------------------------
# The runtime (sailor_core/runtime/data_parallel.py, BUCKET_CAP_BYTES) all-reduces gradients in buckets of
# whole layers, from the last layer back, filled up to 25 MiB (PyTorch DDP's default bucket_cap_mb),
# launched during the last microbatch's backward as soon as a bucket's gradients are final. Each
# bucket is a flat copy of its gradients that the runtime keeps until the step's synchronisation
# ends. Source: the runtime's constant (kept equal by a test), DDP's documentation.
ALLREDUCE_BUCKET_BYTES = 25 * 1024 * 1024
# The Sailor artifact's framework (DeepSpeed's pipeline engine, which ran the published runs) reduces
# a stage's gradients after its last backward in buckets of `reduce_bucket_size` = 5e8 (its default,
# the artifact's simulator times buckets of 5e8 B). Source: DeepSpeed's configuration defaults.
DEEPSPEED_BUCKET_BYTES = 500_000_000
# What the flat copy of one such bucket holds in memory: DeepSpeed's `allreduce_gradients` passes
# MEMORY_OPT_ALLREDUCE_SIZE = 5e8 to `buffered_allreduce_fallback` as *elements* per bucket (gradients
# are gathered until their element count passes it, then flattened into one new tensor and
# all-reduced), so a bucket of fp32 gradients holds up to 2 GB, not 0.5 GB. Source: DeepSpeed's
# runtime/engine.py (allreduce_no_retain's numel_per_bucket).
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
RUNTIMES = ("sailor", "deepspeed")

# --- backward-pass workspace -------------------------------------------------------------------
# While a layer runs backward, autograd holds the layer's saved activations *and* allocates the
# gradients of its largest intermediates: for attention the softmax backward needs dP = dO V^T and
# dS (each the size of the saved probabilities P), for the LM head the cross-entropy backward needs
# the gradient of the logits and the recomputed softmax (each the size of the saved logits). Two
# extra tensors of the size of the layer's dominant saved activations: a factor of 2 on the largest
# layer's `act_mem_bytes`. Source: the autograd formulas of softmax and cross-entropy (dimensionless).
BACKWARD_WORKSPACE_FACTOR = 2.0

# --- profile denoising -----------------------------------------------------------------------
# Profiled microbatch sizes a point is smoothed over (itself and its two nearest neighbours):
# the smallest window whose least-squares line is not an interpolation through every point.
SMOOTHING_WINDOW = 3

# --- pipeline messages -------------------------------------------------------------------------
# Activations and their gradients cross stage boundaries in the compute dtype; the profiler and the
# validation runs are fp32. Source: the format (act_output_floats are fp32 element counts).
P2P_BYTES_PER_ELEMENT = {"fp32": FP32_BYTES, "bf16": BF16_BYTES}

# --- money -------------------------------------------------------------------------------------
SECONDS_PER_HOUR = 3600.0
BYTES_PER_GB = 1e9  # egress is billed per decimal GB (GCP/AWS price sheets)
