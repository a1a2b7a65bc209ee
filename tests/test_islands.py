"""Semi-synchronous islands (runtime/outer_sync.py, runtime/islands.py): the outer step, what crosses
the links, membership, and islands trained as real jobs (worker processes, gloo) on this machine.

The islands of a run meet in a TCPStore on 127.0.0.1 that the test hosts, as the flow or the bench
host it for real runs.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sailor_core.domain import ParallelPlan, PipelineBatch, Replica, Stage
from sailor_core.errors import ValidationError
from sailor_core.models import get_config
from sailor_core.runtime import checkpoint as ckpt
from sailor_core.runtime.engine import TrainSettings
from sailor_core.runtime.islands import IslandSamples, IslandSettings, host_store
from sailor_core.runtime.launcher import run_local
from sailor_core.runtime.outer_sync import (
    OuterState,
    decode,
    encode,
    encoded_bytes,
    fragments_of,
    ring_allreduce,
)
from sailor_core.runtime.quorum import Quorum
from sailor_core.semisync import IslandPlan, OuterSync, islands_from_dict, islands_to_dict

CFG = get_config("gpt-tiny")


# -- the outer step and the codecs, no processes ----------------------------------------------------------


def test_outer_step_without_momentum_at_lr_1_gives_the_mean_of_the_islands() -> None:
    torch.manual_seed(0)
    start = [torch.randn(3, 4), torch.randn(5)]
    a = [p + torch.randn_like(p) for p in start]
    b = [p + torch.randn_like(p) for p in start]
    states = []
    for mine in (a, b):
        params = [p.clone() for p in start]
        st = OuterState(params, OuterSync(inner_steps=1, outer_lr=1.0, momentum=0.0))
        for p, q in zip(params, mine, strict=True):
            p.copy_(q)
        states.append(st)
    total = states[0].pseudo_gradient(0) * 0.5 + states[1].pseudo_gradient(0) * 0.5
    for st in states:
        st.outer_step(total, 0)
        for p, x, y in zip(st.params, a, b, strict=True):
            assert torch.allclose(p, (x + y) / 2, atol=1e-6)


def test_nesterov_outer_step_is_pytorchs_sgd() -> None:
    torch.manual_seed(1)
    start = [torch.randn(4, 4)]
    sync = OuterSync(inner_steps=1, outer_lr=0.7, momentum=0.9)
    params = [start[0].clone()]
    st = OuterState(params, sync)
    ref = torch.nn.Parameter(start[0].clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for _ in range(3):
        g = torch.randn(4, 4)
        st.outer_step(g.reshape(-1), 0)
        ref.grad = g
        sgd.step()
        assert torch.allclose(params[0], ref.detach(), atol=1e-6)


@pytest.mark.parametrize("compression,tolerance", [("none", 0.0), ("bf16", 1e-2), ("int8", 1e-2)])
def test_codecs_round_trip_within_their_precision(compression: str, tolerance: float) -> None:
    torch.manual_seed(2)
    x = torch.cat([torch.randn(100) * 5, torch.randn(50) * 0.01])
    segs = [(0, 100), (100, 150)]
    payload = encode(x, segs, compression)
    assert payload.numel() == encoded_bytes(segs, compression)
    y = decode(payload, segs, compression)
    for a, b in segs:  # per tensor: int8's scale follows each tensor's own range
        err = (y[a:b] - x[a:b]).abs().max() / x[a:b].abs().max()
        assert err <= tolerance
    assert encoded_bytes(segs, "int8") < encoded_bytes(segs, "bf16") < encoded_bytes(segs, "none")


def test_fragments_are_contiguous_and_cover_every_parameter() -> None:
    frags = fragments_of([10, 10, 10, 10, 40], 2)
    assert frags == [[0, 1, 2, 3], [4]]
    assert sorted(i for f in frags for i in f) == list(range(5))


def test_one_member_ring_is_its_codec() -> None:
    x = torch.randn(37)
    assert torch.equal(ring_allreduce(None, x, "none", [(0, 37)], rank=0, size=1), x)


def test_island_plan_round_trips_and_refuses_islands_of_different_shapes() -> None:
    a, b = _plan(dp=2), _plan(dp=1)
    ip = IslandPlan(islands=(a, b), sync=OuterSync(inner_steps=8, compression="int8"))
    assert islands_from_dict(json.loads(json.dumps(islands_to_dict(ip)))) == ip
    assert ip.global_batch_size == 8 and ip.batch_offset(1) == 4
    two_stages = ParallelPlan(model="gpt-tiny", global_batch_size=4, pipelines=(PipelineBatch(microbatch_size=2,
                              num_microbatches=2),), stages=(Stage(first_layer=0, last_layer=2, replicas=(_rep(),)),
                                                             Stage(first_layer=3, last_layer=5, replicas=(_rep(),))))
    with pytest.raises(ValidationError, match="differ in shape"):
        IslandPlan(islands=(a, two_stages), sync=OuterSync(inner_steps=8))
    with pytest.raises(ValidationError, match="divide inner_steps"):
        OuterSync(inner_steps=10, fragments=3)


def test_an_islands_samples_are_its_share_of_each_global_batch() -> None:
    class Ids:
        def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
            t = torch.arange(first, first + count)
            return t, t

    one = IslandSamples(Ids(), island_batch=4, global_batch=10, offset=6)
    assert one.batch(0, 4)[0].tolist() == [6, 7, 8, 9]
    assert one.batch(4, 2)[0].tolist() == [16, 17]
    assert one.batch(2, 4)[0].tolist() == [8, 9, 16, 17]  # across a step's end


def test_members_wait_for_every_island_not_away_then_for_nobody_late() -> None:
    store = dist.HashStore()
    store.set("outer/islands", json.dumps([0, 1, 2]))
    q = Quorum(store, quorum_s=60.0, sleep=lambda s: None)
    q.set_away(2, True)
    got: dict[int, tuple[int, dict]] = {}
    t = threading.Thread(target=lambda: got.setdefault(0, q.members(1, 0, {"tokens": 5, "version": 0})))
    t.start()
    got[1] = q.members(1, 1, {"tokens": 7, "version": 0})
    t.join(10)
    assert got[0] == got[1] and got[0][1]["members"] == [0, 1]
    assert q.decided() == 1
    # came back after step 1 was decided: it joins step 2, where the others, not away, are waited for
    # quorum_s (here 0.5 s of the real clock: 60 s of a spinning poll before) and then marked away
    late = Quorum(store, quorum_s=0.5)
    v, decision = late.members(1, 2, {"tokens": 0, "version": -1})
    assert v == 2 and decision["members"] == [2]
    assert late.away() == {0, 1}


# -- islands as real jobs ----------------------------------------------------------------------------------


def _rep() -> Replica:
    return Replica(gpu_type="cpu", zone="local", tp=1, gpus_per_node=2)


def _plan(dp: int, batch: int = 4, stages: tuple[tuple[int, int], ...] = ((0, 5),)) -> ParallelPlan:
    pipes = tuple(PipelineBatch(microbatch_size=batch // dp // 2, num_microbatches=2) for _ in range(dp))
    return ParallelPlan(model="gpt-tiny", global_batch_size=batch, pipelines=pipes,
                        stages=tuple(Stage(first_layer=a, last_layer=b, replicas=(_rep(),) * dp) for a, b in stages))


class Store:
    """The run's island store, hosted on loopback for the test's islands."""

    def __init__(self, islands: list[int]) -> None:
        self.server, self.address = host_store("127.0.0.1", islands)


def _train_islands(ip: IslandPlan, which: list[int], store: Store, tmp: Path, tag: str, *, steps: int,
                   resume: bool = False) -> None:
    """Trains islands `which` of `ip` at once (one job each, its own workers), to `steps` steps."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        isl = IslandSettings(island=i, sync=ip.sync, store=store.address, global_batch_size=ip.global_batch_size,
                             batch_offset=ip.batch_offset(i))
        settings = TrainSettings(model="gpt-tiny", steps=steps, timeout_s=60, resume=resume,
                                 checkpoint_uri=str(tmp / f"ckpt-{tag}-{i}"), islands=isl.to_dict())
        try:
            run_local(ip.islands[i], CFG, settings, run_dir=str(tmp / f"run-{tag}-{i}-{steps}"))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in which]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def _params(uri: Path) -> dict[str, torch.Tensor]:
    """Every parameter of the newest checkpoint in `uri`, full layout, by layer and name."""
    storage = ckpt.open_storage(str(uri))
    step = ckpt.list_steps(storage)[-1]
    fulls = ckpt.load_layer_states(storage, step, list(range(CFG.num_layers)))
    return {f"{li}.{n}": t for li, st in fulls.items() for n, t in st["params"].items()}


def test_with_h_1_lr_1_and_no_momentum_the_islands_hold_the_mean_of_their_one_step_results(tmp_path: Path) -> None:
    ip = IslandPlan(islands=(_plan(dp=2), _plan(dp=1)), sync=OuterSync(inner_steps=1, outer_lr=1.0, momentum=0.0))
    _train_islands(ip, [0, 1], Store([0, 1]), tmp_path, "both", steps=1)
    alone = []
    for i in (0, 1):  # each island alone: its own one-step result (an outer step on itself is the identity)
        _train_islands(ip, [i], Store([i]), tmp_path, f"alone{i}", steps=1)
        alone.append(_params(tmp_path / f"ckpt-alone{i}-{i}"))
    for i in (0, 1):
        got = _params(tmp_path / f"ckpt-both-{i}")
        for k, p in got.items():
            mean = (alone[0][k] + alone[1][k]) / 2
            assert torch.allclose(p, mean, atol=1e-6, rtol=0), (i, k, (p - mean).abs().max())
        assert any(not torch.equal(alone[0][k], alone[1][k]) for k in got)  # they did differ


def test_a_run_checkpointed_mid_round_resumes_to_the_same_parameters(tmp_path: Path) -> None:
    """Also with momentum, int8 and two fragments: what a checkpoint must carry is all of the outer state."""
    stages = ((0, 2), (3, 5))
    # two fragments (Streaming DiLoCo): one of them is synchronised every 2 steps, in turn
    sync = OuterSync(inner_steps=4, outer_lr=0.7, momentum=0.9, compression="int8", fragments=2)
    ip = IslandPlan(islands=(_plan(dp=1, stages=stages), _plan(dp=1, stages=stages)), sync=sync)
    _train_islands(ip, [0, 1], Store([0, 1]), tmp_path, "straight", steps=8)
    _train_islands(ip, [0, 1], Store([0, 1]), tmp_path, "cut", steps=5)  # stops at step 5: one step into a round
    meta = ckpt.read_meta(ckpt.open_storage(str(tmp_path / "ckpt-cut-0")), 5)
    assert meta["outer"]["steps_in_round"] == 1 and meta["outer"]["version"] == 2
    # the whole run restarts (its store too): every island resumes its round from its checkpoint
    _train_islands(ip, [0, 1], Store([0, 1]), tmp_path, "cut", steps=8, resume=True)
    for i in (0, 1):
        a, b = _params(tmp_path / f"ckpt-straight-{i}"), _params(tmp_path / f"ckpt-cut-{i}")
        for k in a:
            assert torch.allclose(a[k], b[k], atol=1e-6, rtol=0), (i, k, (a[k] - b[k]).abs().max())


def test_islands_of_different_speed_weigh_by_the_tokens_they_trained(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two islands' outer step in one process (a thread each, gloo over loopback): with lr 1 and no
    momentum the new parameters are the mean of the islands' weighted by their tokens in the round."""
    from sailor_core.runtime.islands import IslandRole, IslandSync

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.HashStore()
    store.set("outer/islands", json.dumps([0, 1]))
    start = torch.zeros(6)
    mine = [torch.full((6,), 1.0), torch.full((6,), 4.0)]
    syncs = []
    for i, tokens in enumerate((3.0, 1.0)):  # island 0 trained three times the tokens of island 1
        p = start.clone()
        s = IslandSync(OuterSync(inner_steps=2, outer_lr=1.0, momentum=0.0), [p],
                       IslandRole(island=i, shard=0, leader=True, dp_group=None, dp_src=0), Quorum(store),
                       tokens_per_step=tokens, timeout_s=30, log=lambda m: None)
        p.copy_(mine[i])
        syncs.append(s)
    errors: list[BaseException] = []

    def two_steps(s: IslandSync) -> None:
        try:
            s.after_step()
            s.after_step()  # the second step ends the round: the outer step
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=two_steps, args=(s,)) for s in syncs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for s in syncs:
        assert torch.allclose(s.state.params[0], torch.full((6,), (3 * 1.0 + 1 * 4.0) / 4), atol=1e-6)
        assert s.state.version == 1 and s.state.steps_in_round == 0


def _island_sync(store: Any, island: int, sync: OuterSync, local: float, *, timeout_s: float = 30) -> Any:
    """Island `island`'s outer loop over one parameter (6 zeros, then `local`): one round trained, 1 token."""
    from sailor_core.runtime.islands import IslandRole, IslandSync

    p = torch.zeros(6)
    s = IslandSync(sync, [p], IslandRole(island=island, shard=0, leader=True, dp_group=None, dp_src=0),
                   Quorum(store), tokens_per_step=1.0, timeout_s=timeout_s, log=lambda m: None)
    p.fill_(local)
    s.state.steps_in_round, s.state.tokens_in_round = 1, 1.0
    return s


def _outer_together(syncs: list[Any], firsts: list[int | None]) -> None:
    """Each island's `synchronise(first=...)` at once, a thread each (gloo over loopback)."""
    errors: list[BaseException] = []

    def outer(s: Any, first: int | None) -> None:
        try:
            s.synchronise(first=first)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=outer, args=(s, f)) for s, f in zip(syncs, firsts, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def test_an_island_back_in_a_new_generation_gets_a_new_outer_group_from_every_member(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Island 0 reconfigures (a new generation: a new IslandSync, its state kept in memory) and is back at
    the next outer step with island 1, whose group over {0, 1} is the old island 0's: both must build a new
    one (they waited out the group's timeout, and the step failed, when island 1 kept its old group)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.HashStore()
    store.set("outer/islands", json.dumps([0, 1]))
    sync = OuterSync(inner_steps=1, outer_lr=1.0, momentum=0.0)
    syncs = [_island_sync(store, i, sync, local, timeout_s=5) for i, local in enumerate((1.0, 3.0))]
    _outer_together(syncs, [None, None])
    assert all(s.state.version == 1 for s in syncs)
    old = syncs[0]
    syncs[0] = _island_sync(store, 0, sync, 0.0, timeout_s=5)
    assert syncs[0].adopt(old)  # the new generation holds the old one's outer state (resume from memory)
    for s, local in zip(syncs, (4.0, 6.0), strict=True):
        s.state.params[0].fill_(local)
        s.state.steps_in_round, s.state.tokens_in_round = 1, 1.0
    _outer_together(syncs, [None, None])
    for s in syncs:  # the mean of the two rounds' local results, each time (lr 1, no momentum)
        assert s.state.version == 2, s.state.version
        assert torch.allclose(s.state.params[0], torch.full((6,), 5.0), atol=1e-6), s.state.params[0]


def test_a_stale_island_is_sent_the_global_copy_and_momentum_and_weighs_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An island back from a reconfiguration without outer state (version -1) joins the next outer step:
    the up-to-date island sends it the global copy and momentum first, its own pseudo-gradient weighs 0,
    and both end with the same parameters and momentum (lr 1, Nesterov 0.5: a lost momentum shows)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store = dist.HashStore()
    store.set("outer/islands", json.dumps([0, 1]))
    sync = OuterSync(inner_steps=1, outer_lr=1.0, momentum=0.5)
    syncs = [_island_sync(store, i, sync, local) for i, local in enumerate((1.0, 4.0))]
    syncs[0].state.version = 3
    syncs[0].state.momentum[0].fill_(4.0)
    syncs[1].mark_stale()
    # island 1 joins as rejoin_if_stale has it join: the step after the run's last decided one
    _outer_together(syncs, [None, 4])
    # island 0 alone counts: d = 0 - 1 = -1; m = 0.5 * 4 + d = 1; global = 0 - (d + 0.5 m) = 0.5
    for s in syncs:
        assert torch.allclose(s.state.params[0], torch.full((6,), 0.5), atol=1e-6), s.state.params[0]
        assert torch.allclose(s.state.momentum[0], torch.full((6,), 1.0), atol=1e-6), s.state.momentum[0]
        assert s.state.version == 4


def test_sailor_train_runs_an_island_plan_file_one_job_per_island(tmp_path: Path) -> None:
    """`sailor plan --sync semi --out FILE` writes an island plan; `sailor train FILE` runs its islands here."""
    import subprocess
    import sys

    ip = IslandPlan(islands=(_plan(dp=2), _plan(dp=1)), sync=OuterSync(inner_steps=4, compression="int8"))
    path = tmp_path / "islands.json"
    path.write_text(json.dumps(islands_to_dict(ip)))
    p = subprocess.run([sys.executable, "-m", "sailor_cli.main", "train", str(path), "--steps", "8",
                        "--checkpoint-dir", str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "island 0: done, 8 steps" in p.stdout and "island 1: done, 8 steps" in p.stdout
    a, b = _params(tmp_path / "ckpt" / "island0"), _params(tmp_path / "ckpt" / "island1")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the last step was an outer step: one global copy
