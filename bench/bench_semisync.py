"""Semi-synchronous islands against synchronous training on the testbed (issue 45).

Builds the scenario's testbed (bench/bench_semisync.yaml: three regions, one 1-device VM each, 25-50
Mbit/s between regions, fast links inside a zone; needs root), and a corpus that ships with
Python (pydoc_data's topics and the standard library's docstrings, every 25th docstring held out),
with a BPE tokenizer trained on it by `tokenizers` and its token ids saved as one `.npy` (each worker
reads it whole: the runtime's `TokenDataset`, windows chosen by (seed, sample)).
The model is a small Llama (config.json written here). Then, as the flow does on rented VMs:

- profiles: layer times of the model on every VM at once (each bound to its device, as the runs keep
  every VM busy; per layer the median over the VMs), and every zone pair's link, into a fresh store;
- plans: (a) the fastest synchronous plan over every VM (simulated: data parallel over all, or a
  stage per region in every order and layer split), (a0) the planner's best synchronous plan, which
  may leave VMs idle (timed over --a0-steps only: its gradients, so its loss, are (a)'s), (b) the
  planner's best semi-synchronous plan (`plan_with_sync`, --sync semi: islands per region, H by its
  rule or --inner-steps, --compression, --outer-lr, --outer-momentum), and (c) the planner's best
  synchronous plan over the same devices on a second testbed whose links are all fast (the
  utilization reference; its links profiled there);
- runs: each trained --steps inner steps from the same initial weights on the same samples (global
  sample numbering; islands read their shares), right after a short round of layer profiles, from
  which, with the links measured before, the simulator predicts its tokens/s: nothing of the run
  enters its prediction. Measured: tokens/s over the steps after --warmup (rank 0's step records:
  the islands' include the outer steps), bytes across regions (the htb classes' byte counters on each
  VM's link, by source zone), and the final parameters' loss on the held-out tokens (a semi plan's:
  its global parameters, the same on every island).

Prints one row per plan and writes out/bench_semisync.txt (the table and the last line) and
out/bench_semisync.png (training loss per token of each plan). The last line:

    semi_vs_sync=X utilization_pct=Y loss_gap_pct=Z bytes_ratio=W sim_err_pct=V

semi_vs_sync: tokens/s of (b) over the faster of (a) and (a0); utilization_pct: (b) over (c);
loss_gap_pct: (b)'s held-out loss against (a)'s at the same tokens (signed: positive when (b) is higher);
bytes_ratio: bytes across regions per token of (a) over (b); sim_err_pct: the largest simulator error
of the plans, signed.

    sudo .venv/bin/python bench/bench_semisync.py [--steps 1000] [--warmup 20] [--global-batch-size 48]
        [--compression int8] [--inner-steps 50] [--outer-lr 0.8] [--outer-momentum 0.5] [--lr 3e-3]
        [--quick (60 steps)] [--only a,a0,b,c] [--plan-only]

The defaults are the configuration docs/semisync.md reports: H 50 (the planner's rule, at most 2 % of
a step exposed, gives 85 here; the smaller H loses less loss per token and still moves 100x fewer
bytes than (a)), int8, and an outer step of lr 0.8 with Nesterov momentum 0.5 (DiLoCo's 0.7 and 0.9
lost more at this scale in single-process runs of the same model: docs/semisync.md).

Without root it prints `skipped: needs root: ...` and exits 0. Everything it builds is torn down at the
end, also on an error or a signal.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import validate_testbed as vt  # noqa: E402

from infra.scenario import load_scenario  # noqa: E402
from infra.testbed import Testbed, testbed_support  # noqa: E402
from profiles_store import open_store  # noqa: E402
from profiles_store.tables import GPU_TYPES, LAYER_PROFILES, MODELS  # noqa: E402
from sailor_core.domain import ParallelPlan  # noqa: E402
from sailor_core.plan_format import plan_to_dict  # noqa: E402
from sailor_core.planner import PlanRequest, summarize  # noqa: E402
from sailor_core.planner import plan as plan_sync  # noqa: E402
from sailor_core.planner.islands import SyncMode, plan_with_sync, summarize_islands  # noqa: E402
from sailor_core.runtime.islands import IslandSettings  # noqa: E402
from sailor_core.runtime.protocol import SECRET_ENV, ControlServer, assign_generation, metrics_key, status_key  # noqa: E402
from sailor_core.semisync import IslandPlan  # noqa: E402
from sailor_core.simulator import simulate  # noqa: E402
from sailor_core.simulator.semisync import simulate_islands  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "out"
VOCAB = 1024
SEQ = 64
MODEL = "semisync-llama"
HELD_OUT_EVERY = 25  # every 25th docstring is held out for the final loss
# A small Llama: 2 blocks of hidden 128 (about 0.69 M parameters, 2.8 MB in fp32).
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_attention_heads": 4,
         "num_hidden_layers": 2, "vocab_size": VOCAB, "max_position_embeddings": SEQ, "hidden_act": "silu",
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "initializer_range": 0.02}
log = vt.log


# ------------------------------------------------------------------------------------------
# the corpus, the tokenizer, the model


def corpus_texts() -> tuple[list[str], list[str]]:
    """(training documents, held-out documents): pydoc_data's topics, and the docstrings of the standard
    library's modules, classes and functions (over 80 characters), every HELD_OUT_EVERY-th held out."""
    import pydoc_data
    import sysconfig

    topics = (Path(pydoc_data.__file__).parent / "topics.py").read_text(encoding="utf-8")
    docs: list[str] = []
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__", "test", "tests",
                                                               "idlelib"))
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(dirpath, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                    d = ast.get_docstring(node)
                    if d and len(d) > 80:
                        docs.append(d)
    held = [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY == 0]
    train = [topics] + [d for i, d in enumerate(docs) if i % HELD_OUT_EVERY]
    return train, held


@dataclass
class Corpus:
    data: str  # the prepared token shards (a folder)
    held_out: Any  # numpy token ids of the held-out documents
    config: dict[str, Any]  # TransformerConfig.to_dict() of the model
    config_json: str  # the model's config.json


def build_corpus(work: Path) -> Corpus:
    """Trains the BPE tokenizer, prepares the training shards, encodes the held-out text, writes config.json."""
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from sailor_core.models.hf_config import load_model_config

    train, held = corpus_texts()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(train, trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_path = work / "tokenizer.json"
    tok.save(str(tok_path))
    eos = tok.token_to_id("<|endoftext|>")
    train_ids = np.array([t for e in tok.encode_batch(train) for t in e.ids + [eos]], dtype=np.uint16)
    np.save(work / "tokens.npy", train_ids)  # read whole by every worker: no reader threads beside the compute
    held_ids = np.array([t for e in tok.encode_batch(held) for t in e.ids + [eos]], dtype=np.int64)
    cfg_path = work / "config.json"
    cfg_path.write_text(json.dumps(LLAMA))
    cfg = load_model_config(str(cfg_path), name=MODEL)
    log(f"corpus: {len(train_ids)} training tokens in {len(train)} documents, {len(held_ids)} held out in "
        f"{len(held)}; model {MODEL}: {cfg.num_layers} layers")
    return Corpus(data=str(work / "tokens.npy"), held_out=held_ids, config=cfg.to_dict(), config_json=str(cfg_path))


# ------------------------------------------------------------------------------------------
# the testbed and its profiles


class Bed:
    """One testbed of the scenario's VMs (slow links as the scenario says, or every link `fast_gbps`)."""

    def __init__(self, sc: Any, fast_gbps: float | None = None) -> None:
        self.sc = sc
        rate = (lambda a, b: fast_gbps) if fast_gbps else sc.link_gbps
        self.tb = Testbed.create(run_id="bench-semisync", zones=[z for z, _ in sc.zones], link_gbps=rate)
        self.server = ControlServer(host=self.tb.host_address)
        self.vms = vt.build(self.tb, sc)
        self.region_of = {z: r for z, r in sc.zones}

    def close(self) -> None:
        self.server.close()
        self.tb.teardown()


def profile_layers(bed: Bed, corpus: Corpus, work: Path, tag: str, mbs: list[int],
                   zones: set[str] | None = None) -> list[Any]:
    """One round of the model's layer profiles at tp 1 on every VM (in `zones`) at once, each rank bound to
    its VM's first device, as the run that follows keeps those VMs busy, at the microbatch sizes `mbs`:
    per device type, the median over its VMs of each layer's times (LayerProfile)."""
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    jobs, where = [], []
    for v in (v for v in bed.vms if zones is None or v.zone in zones):
        dest = work / f"layers-{tag}-{v.key}"
        jobs.append((v, ["profile", "model", "--model", MODEL, "--model-config", corpus.config_json, "--device", "cpu",
                         "--gpu-type", v.gpu_type, "--tp", "1", "--mbs", ",".join(map(str, sorted(set(mbs)))),
                         "--json", "--store", str(dest)]))
        where.append((v, dest))
    t0 = time.time()
    vt.run_on(bed.tb, jobs, logs)
    rounds = [open_store(str(dest), seed=False).read(LAYER_PROFILES, {"model": MODEL, "gpu_type": v.gpu_type})
              for v, dest in where]
    log(f"layer profiles ({tag}) at mbs {sorted(set(mbs))} on {len(where)} VMs in {time.time() - t0:.0f} s")
    return vt.median_profiles(rounds)


def profiled_store(bed: Bed, corpus: Corpus, work: Path, name: str, mbs: list[int]) -> Any:
    """A fresh store with the model, the device types (from a first round of layer profiles) and the
    testbed's links (vt.profile: the node's link, every zone pair's)."""
    from sailor_core.models.config import config_from_dict, model_spec

    store_dir = work / name
    store_dir.mkdir()
    store = open_store(str(store_dir), seed=False)
    store.write(MODELS, [model_spec(config_from_dict(corpus.config))])
    first = profile_layers(bed, corpus, work, f"{name}-0", mbs)
    for g in sorted({p.gpu_type for p in first}):
        v = next(v for v in bed.vms if v.gpu_type == g)
        src = open_store(str(work / f"layers-{name}-0-{v.key}"), seed=False)
        store.write(GPU_TYPES, [src.gpu_types()[g]], provenance=vt._prov(v, "bench-semisync"))
        store.replace_layer_profiles(MODEL, g, [p for p in first if p.gpu_type == g],
                                     provenance=vt._prov(v, "bench-semisync"))
    vt.profile(bed.tb, bed.vms, MODEL, store, work, bed.server, bed.sc)
    return store


def pool_of(sc: Any) -> Any:
    from sailor_core.domain import ResourcePool

    return ResourcePool(entries=tuple(sc.offerings))


# ------------------------------------------------------------------------------------------
# runs


@dataclass
class Job:
    """One job on the testbed (a synchronous plan, or one island): its controller, generation, workers."""

    tag: str
    server: ControlServer
    members: list[str]
    procs: list[Any]
    placed: list[tuple[str, int, tuple[int, ...]]]
    gen: int = 0


def start_job(bed: Bed, plan: ParallelPlan, settings: dict[str, Any], work: Path, tag: str) -> Job:
    """Hands out the plan on its own controller and starts an agent (`sailor worker`) on each of its VMs."""
    server = ControlServer(host=bed.tb.host_address)
    placed = vt.assign(plan, bed.vms)
    members = assign_generation(server, 0, plan=plan_to_dict(plan), settings=settings, resume=False, vms=placed)
    by_key = {v.key: v for v in bed.vms}
    procs = []
    for key, devices, _ in placed:
        v = by_key[key]
        run_dir = work / "runs" / tag / key
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {SECRET_ENV: server.secret, "SAILOR_ADVERTISE_ADDR": v.vm.address, "OMP_NUM_THREADS": "1"}
        procs.append(bed.tb.spawn(key, [vt.SAILOR, "worker", "--control", server.endpoint, "--vm-id", key, "--devices",
                                        str(devices), "--first-generation", "0", "--run-dir", str(run_dir),
                                        "--heartbeat", "2", "--grace", "10"],
                                  env=env, log=work / "logs" / f"agent-{tag}-{key}.log"))
    return Job(tag=tag, server=server, members=members, procs=procs, placed=placed)


def wait_jobs(jobs: list[Job], timeout_s: float, work: Path) -> None:
    """Until every job's workers report done; a failure or the deadline raises with where to look."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = {j.tag: [j.server.get(status_key(j.gen, w)) for w in j.members] for j in jobs}
        if all(all(s == "done" for s in ss) for ss in status.values()):
            return
        bad = {t: ss for t, ss in status.items() if any(s and s != "done" for s in ss)}
        if bad:
            raise RuntimeError(f"jobs failed: {bad}; see {work / 'logs'}")
        if any(all(p.poll() is not None for p in j.procs) and not all(status[j.tag]) for j in jobs):
            time.sleep(2.0)
            if any(not all(j.server.get(status_key(j.gen, w)) for w in j.members) for j in jobs):
                raise RuntimeError(f"a job's agents exited before its workers reported; see {work / 'logs'}")
        time.sleep(0.5)
    raise RuntimeError(f"jobs {[j.tag for j in jobs]} did not finish within {timeout_s:.0f} s; see {work / 'logs'}")


def stop_jobs(bed: Bed, jobs: list[Job]) -> None:
    for j in jobs:
        for p in j.procs:
            if p.poll() is None:
                p.terminate()
        for p in j.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for key, _, _ in j.placed:
            bed.tb.kill_processes(key)
        j.server.close()


def records(job: Job) -> list[dict[str, Any]]:
    """Rank 0's step records, by step (a step repeated after a reconfiguration: the last one)."""
    rows = {int(r["step"]): r for r in (json.loads(x) for x in job.server.read_list(metrics_key(job.gen)))}
    return [rows[k] for k in sorted(rows)]


def link_bytes(bed: Bed) -> int:
    """Bytes that have crossed a region boundary into the testbed's VMs so far (htb class counters on
    each VM's link, one class per source zone: infra/testbed.py)."""
    zones = bed.tb.zones
    total = 0
    for v in bed.vms:
        out = subprocess.run(["tc", "-s", "class", "show", "dev", v.vm.veth], capture_output=True, text=True,
                             check=True).stdout
        cls = None
        for line in out.splitlines():
            words = line.split()
            if words[:2] == ["class", "htb"]:
                cls = words[2]
            elif words[:1] == ["Sent"] and cls is not None:
                n = int(cls.split(":")[1], 16) - 10
                if 1 <= n <= len(zones) and bed.region_of[zones[n - 1]] != v.region:
                    total += int(words[1])
                cls = None
    return total


def settings_for(corpus: Corpus, args: argparse.Namespace, tag: str, work: Path, **more: Any) -> dict[str, Any]:
    # every plan: AdamW at lr with 50 warm-up steps, then a cosine decay to a tenth (runtime/lr_schedule.py)
    return {"model": MODEL, "steps": args.steps, "model_config": corpus.config, "data": corpus.data, "lr": args.lr,
            "lr_schedule": "cosine", "warmup_steps": 50, "min_lr_ratio": 0.1,
            "timeout_s": 600, "checkpoint_uri": str(work / f"ckpt-{tag}"), "seed": 0, **more}


@dataclass
class Measured:
    """One plan's run: rank 0's step records per job (one per island), bytes across regions, checkpoints."""

    name: str
    summary: str
    rows: list[list[dict[str, Any]]]
    cross_region_bytes: int
    checkpoints: list[Path]
    sim_tokens_per_s: float
    global_batch_size: int
    held_out_loss: float = float("nan")
    extra: dict[str, Any] = field(default_factory=dict)

    def tokens_per_s(self, warmup: int) -> float:
        """Tokens of the steps after `warmup`, over the time from the end of step `warmup` to the end of the
        last step, the latest job's both times (islands leave an outer step together; they start apart)."""
        start = max(r[warmup - 1]["time"] for r in self.rows)
        end = max(r[-1]["time"] for r in self.rows)
        steps = len(self.rows[0]) - warmup
        return steps * self.global_batch_size * SEQ / (end - start)

    def parts(self, warmup: int) -> str:
        """Where the first job's steps after `warmup` went (medians; outer steps: their mean per step)."""
        rows = self.rows[0][warmup:]
        keys = ("pipeline_s", "grad_sync_s", "agree_s", "optimizer_s")
        med = " ".join(f"{k[:-2]} {statistics.median(float(r.get(k, 0.0)) for r in rows):.3f}" for k in keys)
        outer = [float(r["outer_sync_s"]) for r in rows if "outer_sync_s" in r]
        return med + (f", {len(outer)} outer steps of {statistics.mean(outer):.3f} s" if outer else "")

    def tokens(self) -> int:
        return len(self.rows[0]) * self.global_batch_size * SEQ

    def loss_curve(self) -> tuple[list[int], list[float]]:
        """(tokens, training loss) per step, the jobs' losses weighted by their samples."""
        xs, ys = [], []
        for k in range(len(self.rows[0])):
            recs = [r[k] for r in self.rows]
            xs.append((k + 1) * self.global_batch_size * SEQ)
            ys.append(sum(float(x["loss"]) * int(x["samples"]) for x in recs) / sum(int(x["samples"]) for x in recs))
        return xs, ys


def predict(plan: ParallelPlan | IslandPlan, book: Any) -> float:
    """The simulator's tokens/s for the plan (from the profiles handed in, nothing of its run)."""
    if isinstance(plan, IslandPlan):
        return simulate_islands(plan, book).tokens_per_s
    return simulate(plan, book).tokens_per_s


def points(plan: ParallelPlan | IslandPlan) -> list[int]:
    plans = plan.islands if isinstance(plan, IslandPlan) else (plan,)
    return sorted({m for p in plans for _, _, m in vt.plan_points(p)})


def run_plan(bed: Bed, name: str, plan: ParallelPlan | IslandPlan, book: Any, corpus: Corpus,
             args: argparse.Namespace, work: Path) -> Measured:
    """A round of layer profiles, the prediction from it, then the plan trained (islands: one job each,
    meeting in a store on the host's address)."""
    plans = plan.islands if isinstance(plan, IslandPlan) else (plan,)
    zones = {r.zone for p in plans for st in p.stages for r in st.replicas}
    rnd = profile_layers(bed, corpus, work, f"before-{name}", points(plan), zones)
    sim = predict(plan, vt.book_with(book, rnd))
    label = summarize_islands(plan) if isinstance(plan, IslandPlan) else summarize(plan)
    log(f"({name}) {label}: predicted {sim:,.0f} tokens/s")
    store = None
    jobs: list[Job] = []
    before = link_bytes(bed)
    try:
        if isinstance(plan, IslandPlan):
            store, address = _island_store(bed, len(plan.islands))
            for i, p in enumerate(plan.islands):
                isl = IslandSettings(island=i, sync=plan.sync, store=address, global_batch_size=plan.global_batch_size,
                                     batch_offset=plan.batch_offset(i))
                jobs.append(start_job(bed, p, settings_for(corpus, args, f"{name}-{i}", work, islands=isl.to_dict()),
                                      work, f"{name}-{i}"))
        else:
            jobs.append(start_job(bed, plan, settings_for(corpus, args, name, work), work, name))
        wait_jobs(jobs, args.timeout, work)
        rows = [records(j) for j in jobs]
    finally:
        stop_jobs(bed, jobs)
    after = link_bytes(bed)
    gbs = plan.global_batch_size
    m = Measured(name=name, summary=label, rows=rows, cross_region_bytes=after - before,
                 checkpoints=[work / f"ckpt-{j.tag}" for j in jobs], sim_tokens_per_s=sim, global_batch_size=gbs)
    m.held_out_loss = held_out_loss(m.checkpoints, corpus)
    log(f"({name}) measured {m.tokens_per_s(args.warmup):,.0f} tokens/s, held-out loss {m.held_out_loss:.4f}, "
        f"{m.cross_region_bytes / m.tokens():,.1f} bytes across regions per token; step: {m.parts(args.warmup)}")
    del store
    return m


def _island_store(bed: Bed, n: int) -> tuple[Any, str]:
    from sailor_core.runtime.islands import host_store

    return host_store(bed.tb.host_address, list(range(n)))


def held_out_loss(checkpoints: list[Path], corpus: Corpus) -> float:
    """Mean next-token loss of the newest checkpoint's parameters on the held-out tokens (windows of SEQ);
    the jobs of an island plan must hold the same parameters (checked)."""
    import torch

    from sailor_core.models.config import config_from_dict
    from sailor_core.models.torch_model import StageModel
    from sailor_core.runtime import checkpoint as ckpt

    cfg = config_from_dict(corpus.config)
    states = []
    for c in checkpoints:
        storage = ckpt.open_storage(str(c))
        step = ckpt.list_steps(storage)[-1]
        full = ckpt.load_layer_states(storage, step, list(range(cfg.num_layers)))
        states.append({li: s["params"] for li, s in full.items()})
    for other in states[1:]:
        worst = max(float((a - other[li][k]).abs().max()) for li, st in states[0].items() for k, a in st.items())
        if worst > 1e-6:
            raise RuntimeError(f"the islands' final parameters differ by up to {worst:.2e}")
    model = StageModel(cfg, 0, cfg.num_layers - 1, states=states[0]).eval()
    ids = torch.as_tensor(corpus.held_out)
    n = min(256, (len(ids) - 1) // SEQ)
    windows = torch.stack([ids[i * SEQ:i * SEQ + SEQ + 1] for i in range(n)])
    total = 0.0
    with torch.no_grad():
        for k in range(0, n, 16):
            w = windows[k:k + 16]
            logits = model(w[:, :-1])
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                                             reduction="sum"))
    return total / (n * SEQ)


# ------------------------------------------------------------------------------------------
# plans, report, main


def all_vm_plans(sc: Any, num_layers: int, gbs: int) -> list[ParallelPlan]:
    """Synchronous plans that use every VM of the scenario (one region's VMs per stage, or one stage over all):
    data parallelism over every device, and one pipeline stage per region in every order and layer split,
    data-parallel over the region's devices; microbatches of 1, 2 or 4."""
    import itertools

    from sailor_core.domain import PipelineBatch, Replica, Stage

    regions: dict[str, list[Replica]] = {}
    for o in sc.offerings:
        for _ in range(o.gpus):
            regions.setdefault(o.region, []).append(Replica(gpu_type=o.gpu_type, zone=o.zone, tp=1, market=o.market,
                                                            gpus_per_node=o.gpus_per_vm, region=o.region))
    every = [r for reps in regions.values() for r in reps]
    dp = len(every)
    out = []
    for m in (1, 2, 4):
        if gbs % (dp * m) == 0:
            pipes = tuple(PipelineBatch(microbatch_size=m, num_microbatches=gbs // dp // m) for _ in range(dp))
            out.append(ParallelPlan(model=MODEL, global_batch_size=gbs, pipelines=pipes, stages=(
                Stage(first_layer=0, last_layer=num_layers - 1, replicas=tuple(every)),)))
    per = {len(v) for v in regions.values()}
    if len(per) != 1:
        return out
    d = per.pop()
    for order in itertools.permutations(sorted(regions)):
        for cuts in itertools.combinations(range(1, num_layers), len(order) - 1):
            bounds = [0, *cuts, num_layers]
            for m in (1, 2, 4):
                if gbs % (d * m):
                    continue
                pipes = tuple(PipelineBatch(microbatch_size=m, num_microbatches=gbs // d // m) for _ in range(d))
                out.append(ParallelPlan(model=MODEL, global_batch_size=gbs, pipelines=pipes, stages=tuple(
                    Stage(first_layer=bounds[k], last_layer=bounds[k + 1] - 1, replicas=tuple(regions[r]))
                    for k, r in enumerate(order))))
    return out


def choose_plans(book: Any, sc: Any, args: argparse.Namespace) -> tuple[ParallelPlan, ParallelPlan, IslandPlan]:
    """(a) the fastest synchronous plan over every VM (simulated), (a0) the planner's best synchronous plan
    (which may leave VMs idle), (b) its best semi-synchronous plan."""
    request = PlanRequest(model=MODEL, global_batch_size=args.global_batch_size, pool=pool_of(sc))
    sync = plan_sync(request, book)
    spec = f"semi:{args.inner_steps}" if args.inner_steps else "semi"
    semi = plan_with_sync(request, book, SyncMode.parse(spec, compression=args.compression, outer_lr=args.outer_lr,
                                                        momentum=args.outer_momentum))
    for row in semi.frontier():
        log(f"  {row['sync']:<10} {row['tokens_per_s']:>9,.0f} tokens/s  {row['summary']}")
    if sync.plan is None or semi.chosen is None or semi.chosen.plan is None:
        raise SystemExit(f"no plan: synchronous {sync.nearest_miss or 'found'}; semi-synchronous: {semi.explanation}")
    every = [(simulate(p, book), p) for p in all_vm_plans(sc, book.model.num_layers, args.global_batch_size)]
    every = sorted(((r, p) for r, p in every if r.fits_memory), key=lambda x: -x[0].tokens_per_s)
    for r, p in every[:4]:
        log(f"  every VM   {r.tokens_per_s:>9,.0f} tokens/s  {summarize(p)}")
    return every[0][1], sync.plan, semi.chosen.plan


def report(runs: dict[str, Measured], args: argparse.Namespace) -> str:
    """The table and the last line (see the module's contract)."""
    lines = [f"{'plan':<4} {'tokens/s':>10} {'sim':>9} {'err%':>6} {'held-out loss':>13} {'tokens':>9} "
             f"{'X-region B/token':>16}  what"]
    errs = {}
    for name, m in runs.items():
        tps = m.tokens_per_s(args.warmup)
        errs[name] = (m.sim_tokens_per_s - tps) / tps * 100
        lines.append(f"({name:<2}) {tps:>9,.0f} {m.sim_tokens_per_s:>9,.0f} {errs[name]:>+6.1f} "
                     f"{m.held_out_loss:>13.4f} {m.tokens():>9,} {m.cross_region_bytes / m.tokens():>16,.1f}  "
                     f"{m.summary}")
    a, a0, b, c = runs.get("a"), runs.get("a0"), runs.get("b"), runs.get("c")
    kv: dict[str, float] = {}
    if a and b:  # against the faster synchronous plan: over every VM (a), or the planner's own (a0)
        fastest = max(x.tokens_per_s(args.warmup) for x in (a, a0) if x is not None)
        kv["semi_vs_sync"] = b.tokens_per_s(args.warmup) / fastest
    if b and c:
        kv["utilization_pct"] = b.tokens_per_s(args.warmup) / c.tokens_per_s(args.warmup) * 100
    if a and b:
        kv["loss_gap_pct"] = (b.held_out_loss - a.held_out_loss) / a.held_out_loss * 100
        lower = "(b) semi-synchronous" if b.held_out_loss < a.held_out_loss else "(a) synchronous"
        lines.append(f"held-out loss at {a.tokens():,} tokens: (a) {a.held_out_loss:.4f}, (b) {b.held_out_loss:.4f}: "
                     f"{lower} is lower")
        bpt_b = b.cross_region_bytes / b.tokens()
        kv["bytes_ratio"] = (a.cross_region_bytes / a.tokens()) / bpt_b if bpt_b > 0 else float("inf")
    if errs:
        worst = max(errs.values(), key=abs)
        kv["sim_err_pct"] = worst
    lines.append(" ".join(f"{k}={v:.2f}" if k != "sim_err_pct" else f"{k}={v:+.1f}" for k, v in kv.items()))
    return "\n".join(lines)


def plot(runs: dict[str, Measured], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    names = {"a": "(a) synchronous, every VM", "a0": "(a0) synchronous, the planner's", "b": "(b) semi-synchronous",
             "c": "(c) synchronous, fast links"}
    for name, m in runs.items():
        xs, ys = m.loss_curve()
        k = 20  # a moving mean over 20 steps
        smooth = [statistics.mean(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, label=f"{names[name]}: held-out {m.held_out_loss:.3f}")
    ax.set_xlabel("tokens trained")
    ax.set_ylabel("training loss (20-step mean)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "bench" / "bench_semisync.yaml"))
    ap.add_argument("--steps", type=int, default=1000, help="inner steps of every plan (rounded up to H)")
    ap.add_argument("--warmup", type=int, default=20, help="steps left out of tokens/s")
    ap.add_argument("--global-batch-size", type=int, default=48)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--compression", default="int8", help="what islands send: none, bf16, int8")
    ap.add_argument("--inner-steps", type=int, default=50, help="H (0: the planner's rule)")
    ap.add_argument("--outer-lr", type=float, default=0.8, help="the outer step's learning rate (DiLoCo: 0.7)")
    ap.add_argument("--outer-momentum", type=float, default=0.5, help="its Nesterov momentum (DiLoCo: 0.9)")
    ap.add_argument("--fast-gbps", type=float, default=2.0, help="every link of (c)'s testbed")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per plan")
    ap.add_argument("--only", default="a,a0,b,c", help="the plans to run (a, a0, b, c)")
    ap.add_argument("--a0-steps", type=int, default=200, help="steps of (a0), which is timed only")
    ap.add_argument("--quick", action="store_true", help="60 steps, warm-up 10 (a functional run)")
    ap.add_argument("--plan-only", action="store_true", help="profile and plan on the testbed, print, train nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.a0_steps = 60, 10, 60
    return args


def run_all(args: argparse.Namespace, corpus: Corpus, work: Path) -> dict[str, Measured]:
    """(a) and (b) on the scenario's testbed, then (c) on a testbed of the same VMs with fast links."""
    sc = load_scenario(args.scenario)
    wanted = set(args.only.split(","))
    runs: dict[str, Measured] = {}
    types = sorted({o.gpu_type for o in sc.offerings})
    slow = Bed(sc)
    try:
        book = profiled_store(slow, corpus, work, "store-slow", [1, 2, 4, 8]).profile_book(MODEL, types)
        a, a0, b = choose_plans(book, sc, args)
        h = b.sync.inner_steps
        args.steps = -(-args.steps // h) * h  # every plan trains whole outer rounds
        args.warmup = max(h, -(-args.warmup // h) * h)  # timed from an outer step on: islands start apart
        log(f"every plan trains {args.steps} steps of {args.global_batch_size} sequences (H = {h})")
        if args.plan_only:
            log(f"(a) {summarize(a)}: predicted {predict(a, book):,.0f} tokens/s; (a0) {summarize(a0)}: predicted "
                f"{predict(a0, book):,.0f}; (b) {summarize_islands(b)}: predicted {predict(b, book):,.0f} tokens/s")
            return runs
        if "a" in wanted:
            runs["a"] = run_plan(slow, "a", a, book, corpus, args, work)
        if "a0" in wanted and a0 != a:  # its loss is (a)'s (the same gradients): only its speed is measured
            timed = argparse.Namespace(**{**vars(args), "steps": args.a0_steps})
            runs["a0"] = run_plan(slow, "a0", a0, book, corpus, timed, work)
        if "b" in wanted:
            runs["b"] = run_plan(slow, "b", b, book, corpus, args, work)
    finally:
        slow.close()
    if "c" in wanted and not args.plan_only:
        fast = Bed(sc, fast_gbps=args.fast_gbps)
        try:
            book_fast = profiled_store(fast, corpus, work, "store-fast", [1, 2, 4, 8]).profile_book(MODEL, types)
            request = PlanRequest(model=MODEL, global_batch_size=args.global_batch_size, pool=pool_of(sc))
            c = plan_sync(request, book_fast).plan
            if c is None:
                raise SystemExit("no synchronous plan on fast links")
            runs["c"] = run_plan(fast, "c", c, book_fast, corpus, args, work)
        finally:
            fast.close()
    return runs


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    ok, why = testbed_support()
    if not ok:
        print(f"skipped: needs root: {why}", flush=True)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="sailor-bench-semisync-"))
    (work / "logs").mkdir()
    t0 = time.time()
    try:
        corpus = build_corpus(work)
        runs = run_all(args, corpus, work)
        if not runs:
            return 0
        text = report(runs, args)
        OUT.mkdir(exist_ok=True)
        plot(runs, OUT / "bench_semisync.png")
        load = os.getloadavg()
        header = (f"bench_semisync: {args.steps} steps of {args.global_batch_size} x {SEQ} tokens, "
                  f"{time.time() - t0:.0f} s, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        (OUT / "bench_semisync.txt").write_text(header + "\n" + text + "\n")
        print(header)
        print(text, flush=True)
        return 0
    finally:
        if os.environ.get("SAILOR_KEEP_WORK") != "1":
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work}")


if __name__ == "__main__":
    sys.exit(main())
