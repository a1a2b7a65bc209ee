"""The engine of Sailor on Prefect, and the project's one glossary.

One line per concept: the name on the left is the one the code uses (field, parameter, CLI flag stem),
from the pool file to the runtime; "Drifts:" at the end lists names still in the tree for the same
thing, to be renamed when their owners touch them. docs/architecture.md shows where each concept
lives; docs/formats.md shows how it is written down.

Resources
  gpu_type        A device type by name (`A100-40`, `cpu-fast`; the testbed's "device type"): `GpuType`.
  gpu             One device of a `gpu_type`; every count of devices is `gpus` (`Capacity.gpus`, `Vm.gpus`).
  vm              One rented machine of `gpus_per_vm` GPUs (`Vm`); a TP group never spans two VMs.
  zone, region    Where a VM runs (`Zone`); `region` defaults to the zone less its last `-x` (`default_region`).
  cloud           Who sells it: `gcp`, `aws`, `local` (the testbed); one `Provider` each (infra/provider.py).
  market          `Market.ON_DEMAND` | `Market.SPOT`.
  capacity        What can be rented: `Capacity`: `gpus` in `vms` VMs of `gpus_per_vm`, zone, market, price.
  offering        A `Capacity` a provider reports now (`Provider.offerings()`) or a scenario file lists.
  pool            `ResourcePool`: one `Capacity` per (zone, gpu_type, market); a pool file is its written form.
  catalog shape   `CatalogShape` (infra/catalog.py): a price for one VM shape, not capacity (no count).

The plan (domain.py, validated on construction)
  plan            `ParallelPlan`: stages x pipelines x TP for one model, `global_batch_size`, `schedule`.
  layer           An index in the store's layer numbering: 0 embedding, 1..L blocks, L+1 head.
  stage           `Stage`: layers [first_layer, last_layer], in order; their count is the pipeline depth (pp).
  replica         `Replica`: one copy of one stage on a TP group of `tp` GPUs inside one VM.
  pipeline        Replica j of every stage, with its `PipelineBatch` (`pipelines[j]`): one data-parallel rank.
  data_parallel   The number of pipelines (dp): `ParallelPlan.data_parallel`.
  tp              Tensor-parallel degree of a replica: the GPUs of its TP group.
  microbatch      `microbatch_size` samples through a pipeline at once, `num_microbatches` of them per step.
  global_batch_size  Samples per step over all pipelines.
  rank            One worker process on one GPU; ranks are stage-major (sailor_core/runtime/topology.py).

Planning and estimating
  profile         Measured layer times (`LayerProfile`), network fits (`NetworkLink`); `ProfileBook` per model.
  estimate        The simulator's answer for a plan (`SimulationResult`): `iteration_time_s`, `usd_per_hour`, memory.
  objective       `Objective` under `Constraints` and `Restrictions`: `PlanRequest` in, `PlanResult` out.
  slot            The planner's resource group: one GPU type and market in one region (`Slot`, planner/costs.py).
  layout          The planner's zone fill of one stage, (zone, replicas) pairs (`Layout`, planner/costs.py).

Running
  run             One training job from first plan to teardown, `run_id`; its history is kept in the store.
  job             The run's current plan version on its VMs, as the flow drives it (`Job` in tasks/jobs.py).
  step            One optimizer step over `global_batch_size` samples; `total_steps` is how many a run trains.
  checkpoint_interval  Steps between checkpoints; 0, the default everywhere: automatic (`AUTO_CHECKPOINT_INTERVAL`).
  checkpoint_uri  Where a run's checkpoints live, a folder or s3:// / gs:// URI (`TrainSettings.checkpoint_uri`).
  uri             A local path or s3:// / gs:// URI; one module reads them, handed its environment (uris.py).
  plan_version    The number of a run's plan: 1 first, +1 per switch; the control protocol's generation.
  event           What the monitor sees: `ProviderEvent` (preemption, capacity or price change, lost VM).
  decision        What a replan made of an event: switch or stay, with its reason.

What "automatic" means for checkpoint_interval (sailor_core/planner/risk.py): the flow chooses one per
plan version by Young/Daly; before a plan exists (`sailor plan`, `sailor replay`, the planner's spot
risk) it is the flow's stand-in, 10 steps; `sailor train` checkpoints at the end and on a notice. The
runtime's `TrainSettings.checkpoint_interval` is the resolved number (0 there: at the end).

Drifts:
  node            `gpus_per_node`: the plan's `Replica` and plan JSON, `GpuType`, the planner's `Slot`, traces'
                  `Place` (the store's and the paper's word); a pool file reads it as `gpus_per_vm`'s older name.
  count           A scenario file's `count` is VMs (the file's word; parsed into `Capacity.vms`), a pool file's
                  is GPUs; the planner's `Offer` tuple (planner/costs.py) is (zone, market, GPUs, price).
  dp              The planner's `Sketch.dp` (the paper's D), `len(pipelines)`.
  mbs             Microbatch size in profiles, the planner and the store's `layer_profiles` key.
  iteration_s     The planner's `Estimate.iteration_s`, `Progress.recent_iteration_s` in tasks/jobs.py.
  slot, layout    tasks/jobs.py's `Slot` is a placement; the runtime's `slots=` counts worker processes
                  and its `layout(plan)` is a rank map (sailor_core/runtime/topology.py).
  steps           The flow parameter, `sailor train --steps`, `TrainSettings.steps` (= total_steps).
  --checkpoint-dir  `sailor train`'s flag for checkpoint_uri; `--checkpoint-every` is its older interval flag.
  version         `Job.version`, the run JSON's `plans[].version`, `generation` / `gen` (runtime/protocol.py).
"""
