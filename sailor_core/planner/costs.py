"""What the search asks about costs, and the adapter that answers it with the simulator's model.

Contract: `Costs` is the protocol the search kernel needs (all in seconds, bytes or USD); `SimCosts`
implements it with the simulator's stage-level building blocks (`sailor_core.simulator.model_for`): one
model for the planner and every report. Every answer is memoised, so the search pays each question
once; a link without a network profile answers infinity (`link_gaps` lists them as a value).
`nic_share` and `zone_pairs` say which pipelines' messages share a node's link and which zones a
boundary's sends cross, as the simulator counts them. The slots the questions are about: slots.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from sailor_core.domain import Replica
from sailor_core.errors import MissingProfileError
from sailor_core.planner.slots import Layout, Slot
from sailor_core.profiles import ProfileBook
from sailor_core.simulator import StageCompute, StageMemory, model_for
from sailor_core.simulator import constants as C
from sailor_core.simulator.model import bucket_counts


class Costs(Protocol):
    """The questions the search kernel asks (all in seconds, bytes or USD)."""

    def profiled(self, gpu: str, mbs: int, tp: int) -> bool: ...

    def compute(self, gpu: str, mbs: int, tp: int, first: int, last: int) -> StageCompute: ...

    def stage_compute(self, gpu: str, mbs: int, tp: int, first: int, last: int, *, in_flight: int,
                      first_stage: bool, last_stage: bool) -> StageCompute: ...

    def recomputes(self, gpu: str, tp: int, first: int, last: int, *, mbs: int, in_flight: int, first_stage: bool,
                   last_stage: bool) -> bool: ...

    def optimizer_s(self, gpu: str, mbs: int, tp: int, first: int, last: int) -> float: ...

    def fits(self, gpu: str, tp: int, first: int, last: int, *, mbs: int, in_flight: int, first_stage: bool,
             last_stage: bool) -> bool: ...

    def boundary_bytes(self, tp: int, last: int, mbs: int) -> float: ...

    def p2p_s(self, a: Slot, tp_a: int, zone_a: str, b: Slot, tp_b: int, zone_b: str,
              message_bytes: float, share: int = 1) -> float | tuple[float, float]: ...

    def grad_bytes(self, tp: int, first: int, last: int) -> float: ...

    def linked(self, a: Slot, zone_a: str, b: Slot, zone_b: str) -> bool: ...

    def link_class(self, a: Slot, zone_a: str, b: Slot, zone_b: str) -> int: ...

    def allreduce_s(self, slot: Slot, tp: int, layout: Layout, grad_bytes: float) -> float: ...

    def ring_zones(self, slot: Slot) -> tuple[str, ...]: ...

    def dp_sync_terms(self, slot: Slot, tp: int, layout: Layout, mbs: int, first: int,
                      last: int, recompute: bool = False) -> tuple[float, float, float]: ...

    def egress_usd_per_gb(self, zone_a: str, zone_b: str) -> float: ...

    def tied_sync(self, a: Slot, tp_a: int, zone_a: str, b: Slot, tp_b: int, zone_b: str) -> tuple[float, float]:
        ...


class SimCosts:
    """`Costs` answered by the simulator's memoised `SimModel` of `book`."""

    def __init__(self, book: ProfileBook, *, precision: str = "fp32", recompute: str = "never") -> None:
        """`recompute`: when a stage recomputes its blocks' activations in backward (`Stage.recompute`: the
        extra forward in its time, only each block's input kept per microbatch): "auto" where it does not
        fit in memory without it, "never", "always" (`SearchOptions.recompute`)."""
        self.book = book
        self.sm = model_for(book)
        self.precision = precision
        self.recompute = recompute
        self._msg_bytes = C.P2P_BYTES_PER_ELEMENT[precision]
        self._grad_elem_bytes = C.FP32_GRAD_BYTES if precision == "fp32" else C.BF16_GRAD_BYTES
        self._fits: dict[tuple[object, ...], bool] = {}
        self._p2p: dict[tuple[object, ...], tuple[float, float]] = {}
        self._ar: dict[tuple[object, ...], float] = {}
        self._opt: dict[tuple[object, ...], float] = {}
        self._sync: dict[tuple[object, ...], tuple[float, float, float]] = {}
        self._tied: dict[tuple[object, ...], tuple[float, float]] = {}
        self._replicas: dict[tuple[object, ...], Replica] = {}
        self._ring_zones: dict[tuple[object, ...], tuple[str, ...]] = {}
        self._classes: dict[tuple[object, ...], int] = {}

    def profiled(self, gpu: str, mbs: int, tp: int) -> bool:
        return self.book.has_layers(gpu, mbs, tp)

    def compute(self, gpu: str, mbs: int, tp: int, first: int, last: int) -> StageCompute:
        """Without recomputation: the least a stage of these layers takes (what the bounds may use)."""
        return self.sm.stage_compute(gpu, mbs, tp, first, last)

    def stage_compute(self, gpu: str, mbs: int, tp: int, first: int, last: int, *, in_flight: int,
                      first_stage: bool, last_stage: bool) -> StageCompute:
        """The stage's time in its place of the pipeline: with the extra forward where it recomputes."""
        rc = self.recomputes(gpu, tp, first, last, mbs=mbs, in_flight=in_flight, first_stage=first_stage,
                             last_stage=last_stage)
        return self.sm.stage_compute(gpu, mbs, tp, first, last, rc)

    def recomputes(self, gpu: str, tp: int, first: int, last: int, *, mbs: int, in_flight: int, first_stage: bool,
                   last_stage: bool) -> bool:
        """Whether this stage recomputes under the mode: under "auto" only where it does not fit without."""
        if self.recompute != "auto":
            return self.recompute == "always"
        return not self._fits_as(False, gpu, tp, first, last, mbs, in_flight, first_stage, last_stage)

    def optimizer_s(self, gpu: str, mbs: int, tp: int, first: int, last: int) -> float:
        key = (gpu, mbs, tp, first, last)
        v = self._opt.get(key)
        if v is None:
            v = self.sm.optimizer_time_s(gpu, mbs, tp, first, last)
            self._opt[key] = v
        return v

    def fits(self, gpu: str, tp: int, first: int, last: int, *, mbs: int, in_flight: int, first_stage: bool,
             last_stage: bool) -> bool:
        """Whether the stage fits in memory, recomputing where the mode has it recompute."""
        rc = self.recomputes(gpu, tp, first, last, mbs=mbs, in_flight=in_flight, first_stage=first_stage,
                             last_stage=last_stage)
        return self._fits_as(rc, gpu, tp, first, last, mbs, in_flight, first_stage, last_stage)

    def _fits_as(self, rc: bool, gpu: str, tp: int, first: int, last: int, mbs: int, in_flight: int,
                 first_stage: bool, last_stage: bool) -> bool:
        key = (rc, gpu, tp, first, last, mbs, in_flight, first_stage, last_stage)
        v = self._fits.get(key)
        if v is None:
            mem = self.stage_memory(gpu, tp, first, last, mbs=mbs, in_flight=in_flight, first_stage=first_stage,
                                    last_stage=last_stage, recompute=rc)
            v = mem.total_bytes <= self.book.gpu(gpu).memory_bytes
            self._fits[key] = v
        return v

    def stage_memory(self, gpu: str, tp: int, first: int, last: int, *, mbs: int, in_flight: int,
                     first_stage: bool, last_stage: bool, recompute: bool = False) -> StageMemory:
        """The peak memory `fits` judges: dp=2, so the gradient bucket of a data-parallel ring is counted
        (the safe side for dp=1), with the receive buffers of a stage that has neighbours."""
        return self.sm.stage_memory(
            gpu, tp, first, last, mbs=mbs, in_flight=in_flight, precision=self.precision, dp=2,
            receives_activations=not first_stage, receives_gradients=not last_stage, recompute=recompute,
        )

    def boundary_bytes(self, tp: int, last: int, mbs: int) -> float:
        return float(self.sm.boundary_elems(tp, last) * mbs * self._msg_bytes)

    def p2p_s(self, a: Slot, tp_a: int, zone_a: str, b: Slot, tp_b: int, zone_b: str,
              message_bytes: float, share: int = 1) -> tuple[float, float]:
        """(activation forward, gradient back) seconds across the boundary, `share` pipelines crossing
        through one node's link at once: `SimModel.boundary_p2p_s`."""
        key = (a.gpu_type, a.gpus_per_node, tp_a, zone_a, b.gpu_type, b.gpus_per_node, tp_b, zone_b, message_bytes,
               share)
        v = self._p2p.get(key)
        if v is None:
            ra = Replica(gpu_type=a.gpu_type, zone=zone_a, tp=tp_a, gpus_per_node=a.gpus_per_node,
                         region=a.region_of(zone_a))
            rb = Replica(gpu_type=b.gpu_type, zone=zone_b, tp=tp_b, gpus_per_node=b.gpus_per_node,
                         region=b.region_of(zone_b))
            # Consecutive stages sit on different nodes (ranks are laid out stage by stage).
            try:
                v = self.sm.boundary_p2p_s(ra, rb, message_bytes, same_node=False, share=share)
            except MissingProfileError:
                # No measured link between these GPUs/zones: that boundary is not an option (`link_gaps`).
                v = (math.inf, math.inf)
            self._p2p[key] = v
        return v

    def link_class(self, a: Slot, zone_a: str, b: Slot, zone_b: str) -> int:
        """A number naming what sends between a GPU of `a` in `zone_a` and one of `b` in `zone_b` read of the
        book's links (`SimModel.link_class`): pairs of zones with the same number time every send between
        the same GPU kinds the same, so the link floors time one pair per class."""
        sig = self.sm.link_class(zone_a, a.gpu_type, a.gpus_per_node, zone_b, b.gpu_type, b.gpus_per_node)
        return self._classes.setdefault(sig, len(self._classes))

    def linked(self, a: Slot, zone_a: str, b: Slot, zone_b: str) -> bool:
        """Whether the book has a network profile between a GPU of `a` in `zone_a` and one of `b` in
        `zone_b` (either way, at some GPU count, or a measured all-reduce: `ProfileBook.linked`). Without
        one, every send and ring step between them is infinite, so a placement that needs it is not an option."""
        return self.book.linked(zone_a, a.gpu_type, zone_b, b.gpu_type)

    def grad_bytes(self, tp: int, first: int, last: int) -> float:
        return float(self.sm.stage_params(tp, first, last) * self._grad_elem_bytes)

    def tied_sync(self, a: Slot, tp_a: int, zone_a: str, b: Slot, tp_b: int, zone_b: str) -> tuple[float, float]:
        """(seconds, GB each way) of one pipeline's tied embedding/head exchange between its first stage
        on `a` and its last on `b` (`SimModel.tied_sync_s`; the two stages on different nodes); (0, 0)
        for an untied model."""
        gb = self.sm.tied_weight_bytes() / C.BYTES_PER_GB
        if not gb:
            return 0.0, 0.0
        key = (a.gpu_type, a.gpus_per_node, tp_a, zone_a, b.gpu_type, b.gpus_per_node, tp_b, zone_b)
        v = self._tied.get(key)
        if v is None:
            ra = Replica(gpu_type=a.gpu_type, zone=zone_a, tp=tp_a, gpus_per_node=a.gpus_per_node,
                         region=a.region_of(zone_a))
            rb = Replica(gpu_type=b.gpu_type, zone=zone_b, tp=tp_b, gpus_per_node=b.gpus_per_node,
                         region=b.region_of(zone_b))
            try:
                t = self.sm.tied_sync_s(ra, rb, same_node=False)
            except MissingProfileError:
                t = math.inf
            v = (t, gb)
            self._tied[key] = v
        return v

    def allreduce_s(self, slot: Slot, tp: int, layout: Layout, grad_bytes: float) -> float:
        """The simulator's ring all-reduce for D identical replicas laid out zone by zone.

        The ring (sorted by region, zone, node as in the simulator) waits on its slowest hop at
        every step, so only the distinct kinds of hop matter: within a node, between nodes of a
        zone, and from each zone to the next. Timing those few hops with the simulator's own
        bandwidth function gives its answer in O(zones) instead of O(D) (a test checks equality).
        """
        key = (slot.gpu_type, slot.gpus_per_node, tp, layout, grad_bytes)
        v = self._ar.get(key)
        if v is None:
            try:
                v = self._ring(slot, tp, layout, grad_bytes)
            except MissingProfileError:
                v = math.inf
            self._ar[key] = v
        return v

    def ring_zones(self, slot: Slot) -> tuple[str, ...]:
        """The slot's zones whose one-zone rings can differ: one per class of what a ring inside a zone reads
        (the link between two of its nodes, `SimModel.link_class`, and its measured all-reduce); a zone of the
        same class as an earlier one times every ring the same (the bounds time one zone per class)."""
        key = (slot.gpu_type, slot.gpus_per_node, tuple(z for z, _ in slot.zones))
        v = self._ring_zones.get(key)
        if v is None:
            g, n = slot.gpu_type, slot.gpus_per_node
            seen: dict[tuple[object, ...], str] = {}
            for z, _ in slot.zones:
                ar = self.book.link_allreduce_fit(z, g, z, g)
                seen.setdefault((ar.fit if ar is not None else None, self.sm.link_class(z, g, n, z, g, n)), z)
            v = self._ring_zones[key] = tuple(seen.values())
        return v

    def dp_sync_terms(self, slot: Slot, tp: int, layout: Layout, mbs: int, first: int,
                      last: int, recompute: bool = False) -> tuple[float, float, float]:
        """(ring of every gradient bucket, ring of the last bucket, backward seconds until the first
        bucket is final) for `sailor_core.simulator.dp_sync_end_s`, over the runtime's buckets; a
        `recompute` stage's backward runs its blocks' forward again first."""
        key = (slot.gpu_type, slot.gpus_per_node, slot.region, slot.market, tp, layout, mbs, first, last, recompute)
        hit = self._sync.get(key)
        if hit is not None:
            return hit
        buckets = self.sm.grad_buckets(tp, first, last, self._grad_elem_bytes)
        if not buckets:
            hit = (0.0, 0.0, 0.0)
        else:
            ar = self.allreduce_s(slot, tp, layout, tuple(float(b) for b, _ in buckets))  # type: ignore[arg-type]
            ar_last = self.allreduce_s(slot, tp, layout, (float(buckets[-1][0]),))  # type: ignore[arg-type]
            first_bwd = self.sm.stage_compute(slot.gpu_type, mbs, tp, buckets[0][1], last, recompute).backward_s
            hit = (ar, ar_last, first_bwd)
        self._sync[key] = hit
        return hit

    def _ring(self, slot: Slot, tp: int, layout: Layout, grad_bytes: float) -> float:
        d = sum(n for _, n in layout)
        if d <= 1 or not bucket_counts(grad_bytes):
            return 0.0
        per_node = max(1, slot.gpus_per_node // tp)
        zones = sorted({z for z, n in layout if n > 0}, key=lambda z: (slot.region_of(z), z))
        counts: dict[str, int] = {}
        for z, n in layout:
            counts[z] = counts.get(z, 0) + n
        if len(zones) == 1 and d <= per_node:  # one node: its measured all-reduce, if the store has one
            measured = self.sm.node_allreduce_s(slot.gpu_type, d, tp, grad_bytes)
            if measured is not None:
                return measured

        def rep(zone: str) -> Replica:
            key = (slot.gpu_type, zone, tp, slot.gpus_per_node, slot.region_of(zone), slot.market)
            r = self._replicas.get(key)
            if r is None:  # built (and validated) once per kind: rings are timed thousands of times
                r = self._replicas[key] = Replica(gpu_type=slot.gpu_type, zone=zone, tp=tp,
                                                  gpus_per_node=slot.gpus_per_node, region=slot.region_of(zone),
                                                  market=slot.market)
            return r

        hops: list[tuple[Replica, Replica, bool]] = []
        for z in zones:
            n = counts[z]
            nodes = -(-n // per_node)
            if per_node >= 2 and n >= 2:
                hops.append((rep(z), rep(z), True))
            if nodes >= 2:
                hops.append((rep(z), rep(z), False))
        if len(zones) > 1:
            for i, z in enumerate(zones):
                hops.append((rep(z), rep(zones[(i + 1) % len(zones)]), False))
        flows = max(1, min(tp, slot.gpus_per_node))
        total = 0.0
        for bucket, count in bucket_counts(grad_bytes):
            chunk = bucket / d
            step = max(self.sm.ring_step_s(a, b, flows, chunk, same_node=same)
                       for a, b, same in hops)
            total += count * 2 * (d - 1) * step
        return total

    def allreduce_reference_s(self, slot: Slot, tp: int, layout: Layout, grad_bytes: float) -> float:
        """The same ring through the simulator's O(D) `allreduce_time_s` (for tests)."""
        replicas: list[Replica] = []
        nodes: list[int] = []
        per_node = max(1, slot.gpus_per_node // tp)
        node = 0
        for zone, n in layout:
            r = Replica(gpu_type=slot.gpu_type, zone=zone, tp=tp, gpus_per_node=slot.gpus_per_node,
                        region=slot.region_of(zone), market=slot.market)
            for i in range(n):
                replicas.append(r)
                nodes.append(node + i // per_node)
            node += -(-n // per_node)
        return self.sm.allreduce_time_s(replicas, nodes, grad_bytes)

    def egress_usd_per_gb(self, zone_a: str, zone_b: str) -> float:
        return self.book.egress_usd_per_gb(zone_a, zone_b)


def link_gaps(slots: Sequence[Slot], costs: SimCosts) -> tuple[str, ...]:
    """The links between the slots' GPUs (each GPU type in each of its zones, both ways) that have no
    network profile, in words: the placements that would need them are not options (a value of the pool
    and the book, whatever the search looked at)."""
    ends = sorted({(s.gpu_type, z, s.index) for s in slots for z, n in s.zones if n > 0})
    by_slot = {s.index: s for s in slots}
    seen: set[tuple[str, str, str, str]] = set()
    out = []
    for i, (ga, za, sa) in enumerate(ends):
        for gb, zb, sb in ends[i:]:
            key = (ga, za, gb, zb)
            if key in seen:
                continue
            seen.add(key)
            if not costs.linked(by_slot[sa], za, by_slot[sb], zb):
                out.append(f"{ga} in {za} <-> {gb} in {zb}")
    return tuple(out)


def nic_share(slot_a: Slot, tp_a: int, layout_a: Layout, zone_a: str, slot_b: Slot, tp_b: int, layout_b: Layout,
              zone_b: str) -> int:
    """Pipelines whose messages cross one node's link at once (`simulator.core.nic_sharing` on the
    plan these layouts become): a node of a zone holds gpus_per_node // tp of the stage's replicas
    there, and the busier end of the hop counts."""
    def crowd(slot: Slot, tp: int, layout: Layout, zone: str) -> int:
        return min(max(1, slot.gpus_per_node // max(1, tp)), sum(n for z, n in layout if z == zone))
    return max(1, crowd(slot_a, tp_a, layout_a, zone_a), crowd(slot_b, tp_b, layout_b, zone_b))


def zone_pairs(a: Layout, b: Layout) -> list[tuple[str, str, int]]:
    """Pipelines j run replica j of stage s in a's zone and of stage s+1 in b's: (zone_a, zone_b, count)."""
    out: list[tuple[str, str, int]] = []
    ia = ib = 0
    left_a = a[0][1] if a else 0
    left_b = b[0][1] if b else 0
    while ia < len(a) and ib < len(b):
        n = min(left_a, left_b)
        if n:
            out.append((a[ia][0], b[ib][0], n))
        left_a -= n
        left_b -= n
        if left_a == 0:
            ia += 1
            left_a = a[ia][1] if ia < len(a) else 0
        if left_b == 0:
            ib += 1
            left_b = b[ib][1] if ib < len(b) else 0
    return out
