"""The engine of Sailor on Prefect, and the project's one glossary.

Each concept has one name, used from the pool file to the runtime. The name on the left is the one
new code uses (field, parameter, CLI flag stem); "drifts" lists names still in the tree for the same
thing, to be renamed when their owners touch them (issue 15). docs/architecture.md shows where each
concept lives; docs/formats.md shows how it is written down.

Resources
  gpu_type        A device type by name (`A100-40`, `cpu`, `cpu-fast`): `GpuType` in domain.py. The
                  testbed calls its CPU device types "device types"; to the planner they are GPU types.
  zone, region,   Where a VM runs and who sells it (`Zone`); `region` defaults to the zone minus its
  cloud           last `-x` part (`default_region`).
  market          `Market.ON_DEMAND` | `Market.SPOT`.
  vm              One rented machine of `gpus_per_vm` devices (`Vm` in infra/provider.py). A TP group
                  never spans VMs. Drifts: `node` / `gpus_per_node` (the plan's `Replica`, plan JSON,
                  `GpuType`, the planner's `Slot`, traces: kept there as the store's and the
                  paper's name; the pool file reads `gpus_per_node` as `gpus_per_vm`'s older name).
  capacity        What can be rented: `Capacity` (domain.py): `gpus` GPUs of `gpu_type` in `zone` on
                  `market` in VMs of `gpus_per_vm`, `vms` the whole VMs they make, a price per GPU-hour.
                  `gpus` always counts GPUs; a count of VMs is called `vms`.
  offering        A `Capacity` a provider reports now (`Provider.offerings()`, with `instance_type` and
                  `price_fetched_at`) or a scenario file lists (its `count` is VMs there: the file's
                  word). A catalog's priced VM shape is `CatalogShape` (infra/catalog.py): a price, not
                  capacity. Drifts: the planner's `Offer` tuple (sailor_core/planner/costs.py).
  pool            What may be rented now: `ResourcePool`, one `Capacity` per (zone, gpu_type, market);
                  the pool file is its written form (`count` there is GPUs).

The plan (domain.py, validated on construction)
  plan            `ParallelPlan`: stages x data-parallel pipelines x TP, for one model and one
                  `global_batch_size`, with a `schedule` (`1f1b` | `gpipe`) and a `precision`.
  layer           An index in the store's layer numbering: 0 embedding, 1..L blocks, L+1 head.
  stage           `Stage`: layers [first_layer, last_layer] inclusive; stages tile the layers in order.
  replica         `Replica`: one copy of one stage on a TP group of `tp` GPUs inside one node.
  pipeline        Replica j of every stage; `pipelines[j]` (`PipelineBatch`) is its microbatch size
                  and count. A pipeline is one data-parallel rank.
  data_parallel   The number of pipelines, `ParallelPlan.data_parallel` (== len(plan.pipelines)).
                  Drifts: `dp` (the planner's `Sketch.dp`, the paper's D), `len(pipelines)`.
  tp              Tensor-parallel degree of a replica (GPUs of its TP group).
  microbatch      `microbatch_size` samples that go through a pipeline together;
                  `num_microbatches` per pipeline per step. Drifts: `mbs` (profiles, the planner,
                  the store's `layer_profiles` key; kept there as the paper's and the store's name).
  global_batch_size  Samples per step over all pipelines (the pipelines' samples add up to it).
  rank            One worker process, one GPU of one replica's TP group. Ranks are stage-major
                  (`sailor_core/runtime/topology.py`).

Planning and estimating
  profile         Measured per-layer times (`LayerProfile`) and network fits (`NetworkLink`,
                  `BandwidthFit`) in the profile store; `ProfileBook` bundles what one model needs.
  estimate        What the simulator says a plan costs: `iteration_time_s`, `usd_per_iteration`,
                  `usd_per_hour`, memory (`SimulationResult`). Drifts: `iteration_s` (the planner's
                  `Estimate.iteration_s`, `Progress.recent_iteration_s` in tasks/jobs.py).
  objective       `Objective` (max-throughput, min-cost, min-cost-per-token, max-goodput) with
                  `Constraints` (limits) and `Restrictions` (allowed clouds, zones, GPU types,
                  markets): one `PlanRequest` in, one `PlanResult` (best plan, frontier) out
                  (sailor_core/planner/request.py).
  slot            A planner resource group: GPUs of one type and market in one region at one price
                  (`Slot` in sailor_core/planner/costs.py). Drifts: tasks/jobs.py's `Slot` is a
                  placement (one stage's replica j, call it a placement); the runtime's `slots=`
                  (launcher, topology) is a count of worker processes this machine may run.
  layout          The planner's zone fill of one stage: (zone, replicas) pairs (`Layout` in
                  sailor_core/planner/costs.py). Drifts: the runtime's `layout(plan)`
                  (sailor_core/runtime/topology.py) is a rank map (rank -> stage, pipeline, TP rank).

Running
  run             One training job from first plan to teardown, named by `run_id`; its history
                  (events, decisions, plans, measurements) is kept in the store.
  step            One optimizer step = one iteration over `global_batch_size` samples.
                  `total_steps`: steps the run trains. Drifts: `steps` (the flow parameter and
                  `sailor train --steps`, `TrainSettings.steps`).
  checkpoint_interval  Steps between checkpoints: the flow parameter, `--checkpoint-interval` of
                  `sailor train`, `plan` and `replay` (`--checkpoint-every`: train's older name).
                  0, the default everywhere, is automatic: Young/Daly per plan version in the flow;
                  before a plan exists (`plan`, `replay`, the planner's spot risk) the flow's
                  stand-in, 10 steps; `sailor train` at the end and on a notice
                  (sailor_core/planner/risk.py `AUTO_CHECKPOINT_INTERVAL`). The runtime's
                  `TrainSettings.checkpoint_interval` is the resolved number (0 there: at the end).
  checkpoint_uri  Where a run's checkpoints live (a folder or s3:// / gs:// URI;
                  `TrainSettings.checkpoint_uri`). Drifts: the flag `sailor train --checkpoint-dir`.
  plan_version    The number of the plan a run trains with: 1 for the first plan, +1 for every
                  switch. The control protocol's generation is the same number (a VM joining plan
                  version v waits for generation v). Drifts: `version` (`Job.version`, the run
                  JSON's `plans[].version`), `generation` / `gen` (sailor_core/runtime/protocol.py).
  event           What the monitor sees (preemption, capacity change, price change, lost VM):
                  `ProviderEvent`; a `decision` is what the replan made of it (switch or stay).
"""
