"""Islands in the runtime: who takes part in each outer step, and one rank's part in it.

Contract:
- Every island is an ordinary job (its own process group, plan and checkpoints). The islands of one
  run meet in a torch `Store` (a TCPStore the flow, the bench or a test hosts, `host_store`: torchft's
  lighthouse); who takes part in each outer step is decided there (runtime/quorum.py).
- `IslandSync`: one rank's outer loop, composed into the Trainer (engine.py). Ranks of pipeline 0
  take part: the rank holding (stage s, TP rank t) of every member island forms one gloo group per
  member set (rank = position in the member list, over the store under `outer/v<v>/pg<k>`), kept
  while the members and their incarnations stay the same (an island's leader joins with a token new
  to each IslandSync, so an island back in a new generation makes every member build a new group
  at the same outer step instead of one of them talking to its old group). At a boundary: members
  whose global copy is older than the newest among them (they were away) are sent it, and its
  momentum, from the first up-to-date member; the pseudo-gradients, each weighted by its island's
  tokens over the up-to-date members' tokens (stale ones weigh 0), are summed with
  `ring_allreduce`; every member takes the same outer step. Pipeline 0 then broadcasts the global
  copy, momentum and round to the island's other replicas of its shard over the data-parallel
  group, so every rank holds the outer state whole (any rank's checkpoint, or a reconfigured
  island, has it).
- An island that rejoins (a new generation after a reconfiguration, resumed from its checkpoint or
  memory) whose global copy is older than `outer/decided` joins the next outer step at once, trains
  nothing until then, and starts from the global parameters it is sent.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sailor_core.errors import PeerLost
from sailor_core.models.tensor_parallel import SHARD_ATTR, shard
from sailor_core.runtime.outer_sync import OuterState, ring_allreduce
from sailor_core.runtime.quorum import QUORUM_S, Quorum
from sailor_core.runtime.topology import layout
from sailor_core.semisync import OuterSync


@dataclass(frozen=True, kw_only=True)
class IslandRole:
    """Where this rank sits: its island, its shard index among the island's pipeline-0 ranks (None for
    other replicas), whether it leads the island, its DP group and the global rank of its shard's
    pipeline-0 copy (the broadcast's source)."""

    island: int
    shard: int | None
    leader: bool
    dp_group: Any
    dp_src: int


class IslandSync:
    """One rank's outer loop (see the module's contract)."""

    def __init__(self, sync: OuterSync, params: Sequence[torch.Tensor], role: IslandRole, quorum: Quorum, *,
                 tokens_per_step: float, timeout_s: float, log: Callable[[str], None],
                 wait: Callable[[Any], None] = lambda work: work.wait()) -> None:
        self.sync, self.role, self.quorum, self.log, self.wait = sync, role, quorum, log, wait
        self.state = OuterState(params, sync)
        self.tokens_per_step = tokens_per_step
        self.timeout = timedelta(seconds=timeout_s)
        self._pg: tuple[tuple[tuple[int, str], ...], Any] | None = None  # (members, group) while they stay the same
        self.incarnation = uuid.uuid4().hex[:16]  # this island's generation, as its leader joins outer steps
        self.last_sync_s = 0.0

    # -- a step's end -------------------------------------------------------------------------------
    def after_step(self) -> float | None:
        """Count the step; at a boundary take the outer step. Returns its seconds, or None."""
        st = self.state
        st.steps_in_round += 1
        st.tokens_in_round += self.tokens_per_step
        if st.steps_in_round < self.sync.sync_every:
            return None
        return self.synchronise()

    def rejoin_if_stale(self) -> float | None:
        """After a resume: an island whose global copy is older than the run's joins the next outer
        step now and starts from the global parameters. Returns the step's seconds, or None."""
        decided = self._decided()
        if self.state.version >= decided:
            return None
        self.log(f"island {self.role.island}: global copy at outer step {self.state.version}, the run at "
                 f"{decided}: rejoining")
        self.state.steps_in_round, self.state.tokens_in_round = 0, 0.0
        return self.synchronise(first=decided + 1)

    def _decided(self) -> int:
        """The run's last decided outer step, agreed by the island (its leader reads it)."""
        t = torch.tensor([float(self.quorum.decided()) if self.role.leader else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def synchronise(self, first: int | None = None) -> float:
        """The outer step at this boundary, the first one open from `first` (default: the one after this
        island's last). Collective over the island (see the module's contract)."""
        t0 = time.perf_counter()
        st = self.state
        if self.role.shard is not None:
            v = max(st.version + 1, first or 0)
            if self.role.leader:
                v, decision = self.quorum.members(v, self.role.island, {"tokens": st.tokens_in_round,
                                                  "version": st.version, "incarnation": self.incarnation})
            else:
                v, decision = self._wait_mine(v)
            try:
                self._outer(decision, v)
            except (RuntimeError, PeerLost) as e:  # another island failed mid-way: ours goes on, rejoins later
                self.log(f"island {self.role.island}: outer step {v} failed ({str(e).splitlines()[0][:200]}); "
                         f"training on, to rejoin at the next boundary")
                self._pg = None
        self._share_in_island()
        st.steps_in_round, st.tokens_in_round = 0, 0.0
        self.last_sync_s = time.perf_counter() - t0
        return self.last_sync_s

    def _wait_mine(self, v: int) -> tuple[int, dict[str, Any]]:
        while True:
            decision = self.quorum.wait_members(v, self.timeout.total_seconds() + QUORUM_S)
            if self.role.island in decision["members"]:
                return v, decision
            v += 1

    def _outer(self, decision: dict[str, Any], v: int) -> None:
        """Outer step v with the decided members: bring stale members up to date, all-reduce, step."""
        st, members = self.state, [int(m) for m in decision["members"]]
        info = {int(k): val for k, val in decision["info"].items()}
        newest = max(int(info[m]["version"]) for m in members)
        current = [m for m in members if int(info[m]["version"]) == newest] if newest >= 0 else members[:1]
        pg = self._group(tuple((m, str(info[m].get("incarnation", ""))) for m in members), v)
        if newest < 0 and self.role.island == members[0]:  # nobody holds a global copy: the first one's values
            st.set_flat_state(torch.cat([p.detach().float().reshape(-1) for p in st.params]
                                        + [torch.zeros(m.numel()) for m in st.momentum]), None, to_params=False)
        if len(current) < len(members):  # someone was away: the up-to-date copy first, all of it
            buf = st.flat_state(None)
            if pg is not None:
                pg.broadcast(buf, members.index(current[0])).wait()
            if self.role.island not in current:
                st.set_flat_state(buf, None, to_params=True)
        tokens = sum(float(info[m]["tokens"]) for m in current) or 1.0
        weight = float(info[self.role.island]["tokens"]) / tokens if self.role.island in current else 0.0
        fragment = (v - 1) % self.sync.fragments
        g = st.pseudo_gradient(fragment) * weight
        avg = ring_allreduce(pg, g, self.sync.compression, st.segments(fragment),
                             rank=members.index(self.role.island), size=len(members), tag=v % 1024)
        st.outer_step(avg, fragment)
        st.version = v

    def _group(self, members: tuple[tuple[int, str], ...], v: int) -> Any:
        """The gloo group of this shard over the member islands, (island, incarnation) each: kept while they
        stay the same, else built by every member at this outer step v."""
        if len(members) == 1:
            return None
        if self._pg is not None and self._pg[0] == members:
            return self._pg[1]
        prefix = dist.PrefixStore(f"outer/v{v}/pg{self.role.shard}", self.quorum.store)
        rank = [m for m, _ in members].index(self.role.island)
        pg = dist.ProcessGroupGloo(prefix, rank, len(members), self.timeout)
        self._pg = (members, pg)
        return pg

    def _share_in_island(self) -> None:
        """Pipeline 0's outer state (global copy, momentum, version) to the island's other replicas."""
        if self.role.dp_group is None:
            return
        st = self.state
        buf = torch.cat([st.flat_state(None), torch.tensor([float(st.version)])])
        self.wait(dist.broadcast(buf, src=self.role.dp_src, group=self.role.dp_group, async_op=True))
        if self.role.shard is None:
            st.set_flat_state(buf[:-1], None, to_params=True)
            st.version = int(buf[-1].item())

    # -- checkpoints ------------------------------------------------------------------------------
    def extra_of(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """What a checkpoint's shard file holds of `p` beside its value and moments: its global copy and
        outer momentum (runtime/checkpoint.py's layer_state)."""
        st = self.state
        i = next(k for k, q in enumerate(st.params) if q is p)
        out = {"outer_global": st.global_params[i]}
        if st.momentum:
            out["outer_momentum"] = st.momentum[i]
        return out

    def load(self, fulls: dict[int, dict[str, dict[str, torch.Tensor]]], model: Any, tp: Any,
             meta: dict[str, Any]) -> bool:
        """The outer state of a checkpoint (`fulls`: full-layout layer states, `meta`: its meta.json),
        sharded for this rank; False when the checkpoint has none (the island then rejoins)."""

        st = self.state
        if "outer" not in meta:
            return False
        kinds = ["outer_global", "outer_momentum"] if st.momentum else ["outer_global"]
        with torch.no_grad():
            for li, layer in zip(model.layer_ids, model.layers, strict=True):
                for name, p in layer.named_parameters(remove_duplicate=False):
                    i = next(k for k, q in enumerate(st.params) if q is p)
                    for kind, bank in zip(kinds, (st.global_params, st.momentum), strict=False):
                        full = fulls.get(li, {}).get(kind, {}).get(name)
                        if full is None:
                            return False
                        bank[i].copy_(shard(full, getattr(p, SHARD_ATTR, None), tp.rank, tp.size))
        st.set_round(meta["outer"])
        return True

    def adopt(self, old: IslandSync | None) -> bool:
        """The outer state of this process's previous trainer, when it held the same shard (same
        parameter shapes in the same order); False otherwise (the island then rejoins)."""
        if old is None or [p.shape for p in old.state.params] != [p.shape for p in self.state.params]:
            return False
        st, o = self.state, old.state
        with torch.no_grad():
            for a, b in zip(st.global_params + st.momentum, o.global_params + o.momentum, strict=True):
                a.copy_(b)
        st.set_round(o.round_meta())
        return True

    def mark_stale(self) -> None:
        """No outer state to resume from: rejoin at the next outer step (`rejoin_if_stale`)."""
        self.state.version = -1

    def leave(self) -> None:
        """This island stops taking part (its job ends or reconfigures): the others stop waiting for it.
        Any of its ranks may say so (the leader may be the rank that was lost); it rejoins with its next join."""
        self.quorum.set_away(self.role.island, True)


# -- composition: the trainer's step 8, the worker's samples, checkpoints -------------------------------

@dataclass(frozen=True, kw_only=True)
class IslandSettings:
    """`TrainSettings.islands` as the runtime reads it: this island's id, the outer loop, the store
    ("host:port") and where this island's share sits in each global batch of the whole plan."""

    island: int
    sync: OuterSync
    store: str
    global_batch_size: int
    batch_offset: int

    @staticmethod
    def from_dict(d: dict[str, Any]) -> IslandSettings:
        return IslandSettings(island=int(d["island"]), sync=OuterSync.from_dict(dict(d["sync"])), store=str(d["store"]),
                              global_batch_size=int(d["global_batch_size"]), batch_offset=int(d["batch_offset"]))

    def to_dict(self) -> dict[str, Any]:
        return {"island": self.island, "sync": self.sync.to_dict(), "store": self.store,
                "global_batch_size": self.global_batch_size, "batch_offset": self.batch_offset}


def host_store(address: str, islands: Sequence[int], timeout_s: float = 60.0) -> tuple[Any, str]:
    """The run's island store, hosted by whoever drives the islands (the flow, the bench, a test): a
    TCPStore that listens on `address` only (it is unauthenticated: reachable only where the islands'
    ranks are), with `outer/islands` set. Returns (the store, "host:port" for IslandSettings.store)."""

    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, 0))
    sock.listen(256)
    store = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s),
                          master_listen_fd=sock.detach())
    store.set("outer/islands", json.dumps(list(islands)))
    return store, f"{address}:{store.port}"


def connect_store(address: str, timeout_s: float) -> Any:
    """A client of the run's island store at "host:port"."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


class IslandSamples:
    """An island's view of the run's samples: its sample g is sample (g // b) G + offset + g % b of the
    whole plan (b its batch, G the plan's), so the islands together read each global batch once."""

    def __init__(self, data: Any, island_batch: int, global_batch: int, offset: int) -> None:
        self.data, self.b, self.g, self.offset = data, island_batch, global_batch, offset

    def batch(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = [], []
        at = first
        while at < first + count:
            n = min(first + count - at, self.b - at % self.b)  # up to the end of this step's share
            x, y = self.data.batch((at // self.b) * self.g + self.offset + at % self.b, n)
            xs.append(x)
            ys.append(y)
            at += n
        return (xs[0], ys[0]) if len(xs) == 1 else (torch.cat(xs), torch.cat(ys))


def island_sync_for(settings: IslandSettings | None, *, plan: Any, me: Any, params: Sequence[torch.Tensor],
                    dp_group: Any, tokens_per_step: float, timeout_s: float, log: Callable[[str], None],
                    wait: Callable[[Any], None] = lambda work: work.wait(), store: Any = None) -> IslandSync | None:
    """This rank's `IslandSync`, or None when the run is not semi-synchronous. Pipeline 0's ranks take
    part in the outer all-reduce (shard index = their position among pipeline 0's ranks)."""
    if settings is None:
        return None

    lay = layout(plan)
    zero = [r.rank for r in lay if r.pipeline == 0]
    src = next(r.rank for r in lay if r.stage == me.stage and r.pipeline == 0 and r.tp_rank == me.tp_rank)
    role = IslandRole(island=settings.island, shard=zero.index(me.rank) if me.pipeline == 0 else None,
                      leader=me.rank == 0, dp_group=dp_group, dp_src=src)
    quorum = Quorum(store if store is not None else connect_store(settings.store, timeout_s))
    return IslandSync(settings.sync, params, role, quorum, tokens_per_step=tokens_per_step, timeout_s=timeout_s,
                      log=log, wait=wait)


def resume_outer(sync: IslandSync, *, how: str, step: int | None, storage: Any, previous: IslandSync | None,
                 model: Any, tp: Any) -> None:
    """The outer state after the trainer resumed (`how`, at `step`): from the previous trainer's memory, or
    from the checkpoint it loaded, else stale (the island rejoins); then, collectively, rejoin if stale."""
    from sailor_core.runtime import checkpoint as ckpt

    if how == "none" or step is None:
        pass  # a fresh start: the global copy is the initial parameters
    elif how == "memory" and sync.adopt(previous):
        pass
    elif storage is None or not sync.load(ckpt.load_layer_states(storage, step, list(model.layer_ids)), model, tp,
                                          ckpt.read_meta(storage, step)):
        sync.mark_stale()
    if sync.role.leader:
        sync.quorum.set_away(sync.role.island, False)  # back: the others wait for it again at their boundaries
    sync.rejoin_if_stale()
