"""Simulator formulas against hand-computed cases on a tiny synthetic ProfileBook, and properties."""

from __future__ import annotations

import dataclasses

import pytest

from sailor_core.domain import (
    BandwidthFit,
    EgressPrice,
    GpuPrice,
    GpuType,
    IntraNodeLink,
    LayerProfile,
    LayerSpec,
    Market,
    ModelSpec,
    NetworkLink,
    ParallelPlan,
    PipelineBatch,
    Replica,
    Stage,
    ValidationError,
)
from sailor_core.profiles import MissingProfileError, ProfileBook
from sailor_core.simulator import (
    PlanInvalidError,
    SimModel,
    SimOptions,
    StageCompute,
    model_for,
    pipeline_time_s,
    place_nodes,
    simulate,
)
from sailor_core.simulator import constants as C
from sailor_core.simulator.core import nic_sharing

# Tiny model: layer 0 embedding, 1-2 blocks, 3 head. Per GPU at tp (params halve with tp=2).
PARAMS = {0: 1000, 1: 500, 2: 500, 3: 800}
ACT_BYTES = {0: 100, 1: 400, 2: 400, 3: 900}
OUT_ELEMS = {0: 64, 1: 64, 2: 64, 3: 128}
FWD = {0: 0.001, 1: 0.01, 2: 0.01, 3: 0.004}  # seconds per sample (times are exactly linear in mbs)
BWD = {0: 0.0, 1: 0.02, 2: 0.02, 3: 0.006}
OPT_S = 0.005
GB = 1e9


def const_fit(gbps: float) -> BandwidthFit:
    """A fit whose bandwidth is `gbps` GB/s at every message size."""
    return BandwidthFit(coeffs=(0.0, 0.0, gbps), max_bytes_per_s=gbps * GB)


def make_book(
    *,
    inter_gbps: float = 10.0,
    intra_gbps: float = 100.0,
    mem_bytes: int = 10**6,
    overhead: int = 1000,
    mbs_list: tuple[int, ...] = (1, 2, 4),
    fwd_override: dict[tuple[int, int], float] | None = None,
) -> ProfileBook:
    layers = []
    for tp in (1, 2):
        for i in range(4):
            kind = "embedding" if i == 0 else "head" if i == 3 else "block"
            layers.append(
                LayerSpec(index=i, kind=kind, tp=tp, params=PARAMS[i] // tp, act_output_elems=OUT_ELEMS[i],
                          act_input_elems=OUT_ELEMS[max(0, i - 1)], act_memory_bytes=ACT_BYTES[i] // tp)
            )
    model = ModelSpec(name="tiny", num_blocks=2, hidden_size=8, num_heads=2, sequence_length=16, vocab_size=32,
                      layers=tuple(layers))
    profiles = {}
    for gpu, speed in (("G1", 1.0), ("G2", 2.0)):  # G2 is twice as slow
        for mbs in mbs_list:
            for tp in (1, 2):
                profiles[(gpu, mbs, tp)] = tuple(
                    LayerProfile(
                        model="tiny", gpu_type=gpu, mbs=mbs, tp=tp, layer=i,
                        forward_s=(fwd_override or {}).get((mbs, i), FWD[i] * mbs * speed / tp),
                        backward_s=BWD[i] * mbs * speed / tp, optimizer_s=OPT_S,
                    )
                    for i in range(4)
                )
    zones = ("za", "zb")
    links = tuple(
        NetworkLink(sender_zone=a, sender_gpu=g, sender_count=c, receiver_zone=b, receiver_gpu=h, receiver_count=c,
                    fit=const_fit(inter_gbps * c if a == b else inter_gbps * c / 2))
        for a in zones for b in zones for g in ("G1", "G2") for h in ("G1", "G2") for c in (1, 2)
    )
    intra = tuple(IntraNodeLink(gpu_type=g, num_gpus=2, fit=const_fit(intra_gbps)) for g in ("G1", "G2"))
    return ProfileBook(
        model=model,
        gpu_types={g: GpuType(name=g, memory_bytes=mem_bytes, gpus_per_node=2) for g in ("G1", "G2")},
        layer_profiles=profiles,
        framework_overhead_bytes={"G1": overhead, "G2": overhead},
        links=links,
        intra_node=intra,
        egress=(EgressPrice(sender_zone="za", receiver_zone="zb", usd_per_gb=0.01),
                EgressPrice(sender_zone="zb", receiver_zone="za", usd_per_gb=0.02)),
        prices=tuple(GpuPrice(cloud="x", zone=z, gpu_type=g, market=Market.ON_DEMAND, usd_per_gpu_hour=pr)
                     for z in zones for g, pr in (("G1", 3.6), ("G2", 1.8))),
    )


def rep(gpu: str = "G1", zone: str = "za", tp: int = 1, gpn: int = 2) -> Replica:
    return Replica(gpu_type=gpu, zone=zone, tp=tp, gpus_per_node=gpn)


def plan_of(
    stage_reps: list[tuple[int, int, list[Replica]]], pipes: list[tuple[int, int]], **kw: object
) -> ParallelPlan:
    return ParallelPlan(
        model="tiny",
        global_batch_size=sum(a * b for a, b in pipes),
        stages=tuple(Stage(first_layer=a, last_layer=b, replicas=tuple(r)) for a, b, r in stage_reps),
        pipelines=tuple(PipelineBatch(microbatch_size=a, num_microbatches=b) for a, b in pipes),
        **kw,  # type: ignore[arg-type]
    )


# --- formulas, hand-computed --------------------------------------------------------------------


def test_stage_compute_is_the_sum_of_the_layers() -> None:
    sm = SimModel(make_book())
    c = sm.stage_compute("G1", 2, 1, 1, 3)
    assert c.forward_s == pytest.approx(2 * (0.01 + 0.01 + 0.004))
    assert c.backward_s == pytest.approx(2 * (0.02 + 0.02 + 0.006))
    assert sm.stage_compute("G1", 4, 2, 0, 0).forward_s == pytest.approx(0.001 * 4 / 2)


def test_optimizer_time_is_the_stage_share_of_the_model_step() -> None:
    sm = SimModel(make_book())
    assert sm.optimizer_time_s("G1", 1, 1, 0, 3) == pytest.approx(OPT_S)
    assert sm.optimizer_time_s("G1", 1, 1, 1, 2) == pytest.approx(OPT_S * 1000 / 2800)


def test_smoothing_leaves_affine_profiles_and_pulls_an_outlier_to_its_neighbours_line() -> None:
    exact = SimModel(make_book())
    assert exact.stage_compute("G1", 2, 1, 0, 3).forward_s == pytest.approx(2 * sum(FWD.values()))
    # layer 1 at mbs 2 measured 0.05 instead of 0.02: least-squares line over mbs 1, 2, 4 at x=2
    noisy = make_book(fwd_override={(2, 1): 0.05})
    ys = {1: 0.01, 2: 0.05, 4: 0.04}
    xbar = 7 / 3
    sxx = sum((x - xbar) ** 2 for x in ys)
    slope = sum((x - xbar) * (y - sum(ys.values()) / 3) for x, y in ys.items()) / sxx
    expect = sum(ys.values()) / 3 + slope * (2 - xbar)
    smoothed = SimModel(noisy).stage_compute("G1", 2, 1, 1, 1).forward_s
    assert smoothed == pytest.approx(expect)
    assert 0.02 < smoothed < 0.05
    assert SimModel(noisy, smooth=False).stage_compute("G1", 2, 1, 1, 1).forward_s == pytest.approx(0.05)


def test_pipeline_time_1f1b_and_gpipe_by_hand() -> None:
    comp = [StageCompute(forward_s=1.0, backward_s=3.0), StageCompute(forward_s=3.0, backward_s=1.0)]
    total, comm, finish = pipeline_time_s(comp, [0.5], 4, "1f1b")
    # stage 1 gates: stage 0's first forward and its send (1 + 0.5), then 4 microbatches of
    # F + B = 4 with the boundary (0.5 both ways at once) between them 3 times, then the last
    # gradient back and stage 0's last backward (0.5 + 3): 1.5 + 16 + 1.5 + 3.5 = 22.5
    assert total == pytest.approx(22.5)
    assert comm == pytest.approx(1 + 3 * 0.5)
    # stage 1 finishes before stage 0 by stage 0's backward plus the gradient send
    assert finish == pytest.approx([22.5, 22.5 - 3.5])
    total_g, _, _ = pipeline_time_s(comp, [0.5], 4, "gpipe")
    # GPipe: a message moves once its receive is posted, which the busy stage posts after its previous
    # microbatch: stage 1's forwards run every 3 + 0.5 s (from 1 + 0.5 to 15), its backwards at 16-19,
    # then stage 0's backwards every 0.5 + 3 s from 19.5 to 30
    assert total_g == pytest.approx(1 + 4 * 3.5 + 4 * 1 + 4 * 3.5 - 3)
    one, _, _ = pipeline_time_s(comp[:1], [], 5)
    assert one == pytest.approx(5 * 4)


def test_p2p_time_uses_the_link_fit_and_tp_ranks_share_it() -> None:
    sm = SimModel(make_book(inter_gbps=10.0, intra_gbps=100.0))
    msg = 64 * 2 * 4  # boundary elems x mbs x fp32
    assert sm.p2p_time_s(rep(), rep(), msg, same_node=False) == pytest.approx(msg / 10e9)
    assert sm.p2p_time_s(rep(), rep(), msg, same_node=True) == pytest.approx(msg / 100e9)
    # tp=2: two ranks send at once over the fit measured with 2 GPUs (20 GB/s aggregate): 10 GB/s each
    assert sm.p2p_time_s(rep(tp=2), rep(tp=2), msg, same_node=False) == pytest.approx(msg / 10e9)
    # across zones the synthetic link is half as fast
    assert sm.p2p_time_s(rep(), rep(zone="zb"), msg, same_node=False) == pytest.approx(msg / 5e9)


def test_a_tp_groups_message_crosses_once_in_slices_and_is_all_gathered() -> None:
    """Both runtimes cut a message between stages into one slice per rank of the receiving TP group:
    the slices share the nodes' link, then the receivers all-gather them over their node's pairs.
    DeepSpeed (pipe_partitioned / grad_partitioned, on by default) cuts into min(tp) slices; ours into
    tp_recv slices forward and tp_send back (pipeline_schedule.P2P)."""
    sm = SimModel(make_book(inter_gbps=10.0, intra_gbps=100.0))
    msg = 1e6
    sliced = (msg / 2) / 10e9 + (msg / 2) / 100e9  # two halves share 20 GB/s, one half over the pair
    assert sm.partitioned_p2p_s(rep(tp=2), rep(tp=2), msg, same_node=False) == pytest.approx(sliced)
    assert sm.boundary_p2p_s(rep(tp=2), rep(tp=2), msg, same_node=False) == pytest.approx((sliced, sliced))
    # tp 2 -> tp 1: one whole message forward, two slices back to the TP group
    assert sm.boundary_p2p_s(rep(tp=2), rep(), msg, same_node=False) == pytest.approx((msg / 10e9, sliced))
    # without TP both send one whole message
    assert sm.partitioned_p2p_s(rep(), rep(), msg, same_node=False) == pytest.approx(msg / 10e9)
    # whole copies, one per receiving rank, would take twice as long on the link
    assert sm.p2p_time_s(rep(tp=2), rep(tp=2), msg, same_node=False, copies=2) == pytest.approx(msg / 10e9)


def test_pipelines_crossing_through_one_node_share_its_link() -> None:
    """Two tp=1 replicas of a stage on one 2-GPU node send to two replicas on another node at the
    same time: their messages share the link measured with 2 GPUs, or the one NIC measured with 1."""
    two = [rep(), rep()]
    plan = plan_of([(0, 1, two), (2, 3, two)], [(1, 4), (1, 4)])
    nodes = place_nodes(plan)
    assert nodes == [[0, 0], [1, 1]]
    assert nic_sharing(nodes) == [[2, 2]]
    # a node with one NIC: only the count-1 fit is known, so each of the two flows gets half of it
    book = make_book(inter_gbps=10.0)
    one_nic = dataclasses.replace(book, links=tuple(lk for lk in book.links if lk.sender_count == 1))
    sm = SimModel(one_nic)
    msg = 1e6
    assert sm.boundary_p2p_s(rep(), rep(), msg, same_node=False, share=2) == pytest.approx(
        (msg / 5e9, msg / 5e9))
    assert sm.boundary_p2p_s(rep(), rep(), msg, same_node=False) == pytest.approx((msg / 10e9, msg / 10e9))
    # per-GPU NICs (the count-2 fit is twice the count-1 fit): sharing costs nothing
    assert SimModel(book).boundary_p2p_s(rep(), rep(), msg, same_node=False, share=2) == pytest.approx(
        (msg / 10e9, msg / 10e9))
    shared_nic = simulate(plan, one_nic).breakdown.pipeline_p2p_s
    apart = simulate(plan_of([(0, 1, [rep(), rep(zone="zb")]), (2, 3, [rep(), rep(zone="zb")])], [(1, 4), (1, 4)]),
                     one_nic).breakdown.pipeline_p2p_s
    assert shared_nic > apart
    # one pipeline per node on each side: nobody to share with
    assert nic_sharing([[0, 1], [2, 3]]) == [[1, 1]]
    # a hop inside one node does not touch the NIC
    assert nic_sharing([[0, 0], [0, 1]]) == [[1, 1]]
    # pipelines of different paces (here other GPU types) drift apart: not counted as sharing
    assert nic_sharing(nodes, ["fast", "slow"]) == [[1, 1]]
    mixed = plan_of([(0, 1, two), (2, 3, [rep(), rep("G2")])], [(1, 4), (1, 4)])
    alike = plan_of([(0, 1, two), (2, 3, [rep("G2"), rep("G2")])], [(1, 4), (1, 4)])
    assert (simulate(mixed, one_nic).breakdown.pipeline_time_per_pipeline_s[1]
            < simulate(alike, one_nic).breakdown.pipeline_time_per_pipeline_s[1])


def test_ring_allreduce_by_hand_with_buckets() -> None:
    sm = SimModel(make_book(inter_gbps=10.0))
    two = [rep(), rep()]
    assert sm.allreduce_time_s(two, [0, 1], 1e8) == pytest.approx(2 * 1 * (1e8 / 2) / 10e9)
    # 6e8 B = one 5e8 B bucket and one 1e8 B bucket, each a ring of its own
    assert sm.allreduce_time_s(two, [0, 1], 6e8) == pytest.approx(2 * (2.5e8 + 0.5e8) / 10e9)
    four = [rep(), rep(), rep(zone="zb"), rep(zone="zb")]
    # the slowest hop (across zones, 5 GB/s) gates each of the 2(D-1) steps
    assert sm.allreduce_time_s(four, [0, 1, 2, 3], 4e8) == pytest.approx(2 * 3 * 1e8 / 5e9)
    assert sm.allreduce_time_s([rep()], [0], 4e8) == 0.0


def test_a_data_parallel_group_inside_one_node_uses_the_measured_all_reduce() -> None:
    from dataclasses import replace

    from sailor_core.domain import NodeAllReduce

    measured = NodeAllReduce(gpu_type="G1", workers=2, fit=const_fit(1.0))  # 1 GB/s algorithm bandwidth
    sm = SimModel(replace(make_book(inter_gbps=10.0, intra_gbps=100.0), node_allreduce=(measured,)))
    two = [rep(), rep()]
    # one node: the measured collective, bucket by bucket (5e8 + 1e8 B at 1 GB/s)
    assert sm.allreduce_time_s(two, [0, 0], 6e8) == pytest.approx(6e8 / 1e9)
    # two nodes, other group sizes or TP replicas: the ring composed from link hops, as before
    assert sm.allreduce_time_s(two, [0, 1], 1e8) == pytest.approx(2 * 1 * (1e8 / 2) / 10e9)
    assert sm.allreduce_time_s([rep(), rep(), rep()], [0, 0, 0], 1e8) == pytest.approx(2 * 2 * (1e8 / 3) / 100e9)
    assert sm.node_allreduce_s("G1", 2, 2, 1e8) is None and sm.node_allreduce_s("G2", 2, 1, 1e8) is None



def test_a_ring_step_over_a_link_whose_all_reduce_was_measured_is_timed_from_that_measurement() -> None:
    from dataclasses import replace

    from sailor_core.domain import LinkAllReduce
    from sailor_core.planner.costs import SimCosts
    from sailor_core.planner.slots import Slot

    # the link's ping-pong says 5 GB/s across zones; the two machines' all-reduce over it, 1 GB/s (algorithm bw)
    measured = [LinkAllReduce(zone_a=a, gpu_a="G1", zone_b=b, gpu_b="G1", fit=const_fit(1.0))
                for a, b in (("za", "zb"), ("zb", "za"))]
    book = replace(make_book(inter_gbps=10.0), link_allreduce=tuple(measured))
    sm = SimModel(book)
    across = [rep(), rep(zone="zb")]
    # two workers: the measured all-reduce of the whole bucket, t(1e8) = 0.1 s (two steps of t(2 x 5e7) / 2)
    assert sm.allreduce_time_s(across, [0, 1], 1e8) == pytest.approx(1e8 / 1e9)
    # four workers over two zones: every step waits for the measured hop, 2(D-1) x t(2 x 2.5e7) / 2
    four = [rep(), rep(), rep(zone="zb"), rep(zone="zb")]
    assert sm.allreduce_time_s(four, [0, 1, 2, 3], 1e8) == pytest.approx(6 * (2 * 2.5e7 / 1e9) / 2)
    # where nothing was measured (inside a zone, other GPU types, TP rings sharing the link): the link fit
    assert sm.allreduce_time_s([rep(), rep()], [0, 1], 1e8) == pytest.approx(2 * (1e8 / 2) / 10e9)
    assert sm.allreduce_time_s([rep("G2"), rep("G2", zone="zb")], [0, 1], 1e8) == pytest.approx(2 * 5e7 / 5e9)
    assert sm.allreduce_time_s([rep(tp=2), rep(zone="zb", tp=2)], [0, 1], 1e8) == pytest.approx(2 * 5e7 / 5e9)
    # the planner's ring costs the same step
    slot = Slot(index=0, gpu_type="G1", market=Market.ON_DEMAND, region="", cloud="x", gpus_per_node=2,
                usd_per_gpu_hour=1.0, zones=(("za", 1), ("zb", 1)))
    costs = SimCosts(book, precision="fp32")
    assert costs.allreduce_s(slot, 1, (("za", 1), ("zb", 1)), 1e8) == pytest.approx(1e8 / 1e9)
def test_memory_terms_by_hand() -> None:
    sm = SimModel(make_book(overhead=1000))
    m = sm.stage_memory("G1", 1, 1, 2, mbs=2, in_flight=3, receives_activations=True, receives_gradients=True)
    params = 1000
    assert m.weights_bytes == 4 * params and m.gradients_bytes == 4 * params and m.optimizer_bytes == 8 * params
    assert m.activations_bytes == (400 + 400) * 2 * 3
    assert m.workspace_bytes == int(C.BACKWARD_WORKSPACE_FACTOR * 400 * 2)
    assert m.p2p_buffers_bytes == 64 * 2 * 4 * 3 + 64 * 2 * 4
    assert m.framework_bytes == 1000
    assert m.total_bytes == 1000 + 16 * params + 4800 + 1600 + 2048
    bf = sm.stage_memory("G1", 1, 1, 2, mbs=2, in_flight=3, precision="bf16")
    assert bf.weights_bytes + bf.gradients_bytes + bf.optimizer_bytes == 16 * params
    assert bf.activations_bytes == 4800 // 2
    z = sm.stage_memory("G1", 1, 1, 2, mbs=2, in_flight=3, zero1=True, dp=4)
    assert z.optimizer_bytes == 8 * params // 4
    # a bucket larger than the freed activations shows up; here the activations are larger
    assert z.comm_buffer_bytes == 0


def test_the_optimizer_steps_temporaries_count_beyond_the_freed_activations() -> None:
    """torch's multi-tensor AdamW allocates sqrt(exp_avg_sq), 4 B per parameter it steps, after the
    backward's activations and workspace are freed: only the excess adds to the peak."""
    sm = SimModel(make_book())
    params, freed = 1000, 800 + int(C.BACKWARD_WORKSPACE_FACTOR * 400)  # layers 1-2 at mbs 1, one in flight
    m = sm.stage_memory("G1", 1, 1, 2, mbs=1, in_flight=1)
    assert m.optimizer_step_bytes == 4 * params - freed
    assert m.total_bytes == m.framework_bytes + 16 * params + freed + (4 * params - freed)
    # ZeRO-1 over 4 replicas steps a quarter of the parameters: 1000 B, less than what was freed
    assert sm.stage_memory("G1", 1, 1, 2, mbs=1, in_flight=1, zero1=True, dp=4).optimizer_step_bytes == 0
    # more microbatches in flight free more than the temporaries need
    assert sm.stage_memory("G1", 1, 1, 2, mbs=2, in_flight=3).optimizer_step_bytes == 0
    assert sm.stage_memory("G1", 1, 1, 2, mbs=1, in_flight=1, runtime="deepspeed").optimizer_step_bytes == 0


def test_deepspeeds_gradient_bucket_is_counted_in_elements(monkeypatch) -> None:
    """DeepSpeed flattens up to 5e8 gradient *elements* per all-reduce bucket (2 GB in fp32) into one
    contiguous copy after the last backward; the activations freed before it are separate cached blocks
    that cannot hold it, so it adds to the peak in full. Ours makes 25 MiB copies while the backward frees
    activations: they add only beyond what was freed."""
    sm = SimModel(make_book())
    params, freed = 1000, 800 + int(C.BACKWARD_WORKSPACE_FACTOR * 400)  # layers 1-2 at mbs 1, one in flight
    whole = sm.stage_memory("G1", 1, 1, 2, mbs=1, in_flight=1, dp=2, runtime="deepspeed")
    assert whole.comm_buffer_bytes == 4 * params  # the whole stage fits one bucket
    ours = sm.stage_memory("G1", 1, 1, 2, mbs=1, in_flight=1, dp=2)
    assert ours.comm_buffer_bytes == 4 * params - freed
    monkeypatch.setattr(C, "DEEPSPEED_BUCKET_ELEMENTS", 500)
    sm = SimModel(make_book())
    capped = sm.stage_memory("G1", 1, 1, 2, mbs=1, in_flight=1, dp=2, runtime="deepspeed")
    assert capped.comm_buffer_bytes == 4 * 500  # 500 fp32 elements, not 500 bytes
    assert sm.stage_memory("G1", 1, 1, 2, mbs=1, in_flight=1, dp=1, runtime="deepspeed").comm_buffer_bytes == 0


def test_in_flight_microbatches_follow_the_schedule() -> None:
    book = make_book()
    plan = plan_of([(0, 1, [rep()]), (2, 2, [rep()]), (3, 3, [rep()])], [(1, 8)])
    r = simulate(plan, book)
    assert [x.in_flight_microbatches for x in r.per_stage] == [3, 2, 1]
    g = simulate(plan, book, options=SimOptions(schedule="gpipe"))
    assert [x.in_flight_microbatches for x in g.per_stage] == [8, 8, 8]
    assert g.per_stage[0].memory.activations_bytes > r.per_stage[0].memory.activations_bytes
    assert g.peak_memory_bytes >= r.peak_memory_bytes  # here the optimizer step's temporaries set both peaks


def test_nodes_pack_tp_groups_in_rank_order() -> None:
    plan = plan_of([(0, 1, [rep(), rep()]), (2, 3, [rep(tp=2), rep()])], [(1, 2), (1, 2)])
    assert place_nodes(plan) == [[0, 0], [1, 2]]


def test_single_stage_iteration_by_hand() -> None:
    book = make_book(inter_gbps=10.0)
    per_mb = 2 * sum(FWD.values()) + 2 * sum(BWD.values())
    grads = 2800 * 4
    # one GPU per node: the ring crosses the network (10 GB/s)
    r = simulate(plan_of([(0, 3, [rep(gpn=1), rep(gpn=1)])], [(2, 3), (2, 3)]), book)
    ar = 2 * 1 * (grads / 2) / 10e9
    assert r.iteration_time_s == pytest.approx(3 * per_mb + ar + OPT_S, rel=1e-12)
    assert r.breakdown.dp_sync_exposed_s == pytest.approx(ar, rel=1e-9)
    assert r.tokens_per_s == pytest.approx(12 * 16 / r.iteration_time_s)
    # two GPUs per node: both replicas share one node and the ring runs over the intra-node link
    r2 = simulate(plan_of([(0, 3, [rep(), rep()])], [(2, 3), (2, 3)]), book)
    assert r2.breakdown.dp_sync_exposed_s == pytest.approx(grads / 100e9, rel=1e-9)


# --- cost -----------------------------------------------------------------------------------------


def test_cost_is_price_times_gpus_times_time_plus_egress() -> None:
    book = make_book()
    plans = [
        plan_of([(0, 3, [rep(), rep(gpu="G2")])], [(2, 2), (2, 2)]),
        plan_of([(0, 1, [rep(tp=2), rep(zone="zb")]), (2, 3, [rep(zone="zb"), rep(gpu="G2", zone="zb")])],
                [(1, 4), (2, 2)]),
    ]
    for plan in plans:
        r = simulate(plan, book)
        gpu_hours = sum(
            (3.6 if x.gpu_type == "G1" else 1.8) * x.tp for st in plan.stages for x in st.replicas
        ) * r.iteration_time_s / 3600
        assert r.usd_per_iteration == pytest.approx(gpu_hours + r.egress_usd_per_iteration)
        assert r.usd_per_hour == pytest.approx(r.usd_per_iteration * 3600 / r.iteration_time_s)


def test_egress_by_hand() -> None:
    book = make_book()
    # two stages in different zones, one pipeline: activations za->zb and gradients zb->za per microbatch
    plan = plan_of([(0, 1, [rep()]), (2, 3, [rep(zone="zb")])], [(2, 5)])
    r = simulate(plan, book)
    msg = 64 * 2 * 4
    assert r.egress_usd_per_iteration == pytest.approx(5 * msg / 1e9 * (0.01 + 0.02))
    # a data-parallel ring across zones: two hops cross, each carrying 2(D-1)/D x stage gradients
    plan2 = plan_of([(0, 3, [rep(), rep(zone="zb")])], [(1, 2), (1, 2)])
    r2 = simulate(plan2, book)
    grads = 2800 * 4
    assert r2.egress_usd_per_iteration == pytest.approx(grads / 1e9 * (0.01 + 0.02))


def test_price_override_and_unpriced() -> None:
    book = make_book()
    plan = plan_of([(0, 3, [rep()])], [(1, 1)])
    r = simulate(plan, book, options=SimOptions(prices_usd_per_gpu_hour={("za", "G1", Market.ON_DEMAND): 36.0}))
    assert r.usd_per_iteration == pytest.approx(36.0 * r.iteration_time_s / 3600)
    spot = plan_of([(0, 3, [Replica(gpu_type="G1", zone="za", market=Market.SPOT, gpus_per_node=2)])], [(1, 1)])
    r2 = simulate(spot, book)
    assert r2.unpriced == (("za", "G1", "spot"),)


# --- properties -------------------------------------------------------------------------------------


def _plans() -> list[ParallelPlan]:
    return [
        plan_of([(0, 3, [rep(), rep(), rep(zone="zb")])], [(2, 2), (2, 2), (2, 2)]),
        plan_of([(0, 1, [rep(), rep()]), (2, 3, [rep(zone="zb"), rep()])], [(1, 6), (1, 6)]),
        plan_of([(0, 0, [rep(tp=2)]), (1, 2, [rep(tp=2)]), (3, 3, [rep(gpu="G2")])], [(4, 3)]),
    ]


@pytest.mark.parametrize("scale", [1.5, 4.0, 100.0])
def test_more_bandwidth_is_never_slower(scale: float) -> None:
    slow, fast = make_book(inter_gbps=1.0, intra_gbps=5.0), make_book(inter_gbps=scale, intra_gbps=5.0 * scale)
    for plan in _plans():
        assert simulate(plan, fast).iteration_time_s <= simulate(plan, slow).iteration_time_s + 1e-12


def test_more_memory_never_makes_a_fitting_plan_not_fit() -> None:
    for plan in _plans():
        peaks = [simulate(plan, make_book(mem_bytes=m)) for m in (10**4, 10**5, 10**6, 10**9)]
        fits = [r.fits_memory for r in peaks]
        assert fits == sorted(fits)  # False ... False, True ... True
        assert fits[-1]


def test_oom_is_a_result_with_stage_replica_and_bytes_over() -> None:
    book = make_book(mem_bytes=30_000)
    plan = plan_of([(0, 1, [rep()]), (2, 3, [rep()])], [(4, 4)])
    r = simulate(plan, book)
    assert not r.fits_memory
    worst = r.oom[0]
    assert worst.bytes_over == worst.peak_memory_bytes - 30_000 > 0
    assert r.to_json()["oom"][0] == {"stage": worst.stage, "replica": worst.replica, "bytes_over": worst.bytes_over}


def test_heterogeneous_microbatches_the_slowest_pipeline_gates_the_sync() -> None:
    book = make_book()
    # pipeline 0 on the fast GPU takes 4 microbatches of 2; pipeline 1 on the slow GPU 2 of 2... and one of 4
    plan = plan_of([(0, 3, [rep(), rep(gpu="G2")])], [(2, 4), (4, 1)])
    r = simulate(plan, book)
    t = r.breakdown.pipeline_time_per_pipeline_s
    per_sample_fast = sum(FWD.values()) + sum(BWD.values())
    assert t[0] == pytest.approx(8 * per_sample_fast)
    assert t[1] == pytest.approx(4 * 2 * per_sample_fast)
    assert r.breakdown.slowest_pipeline == max(range(2), key=lambda j: t[j])
    assert r.iteration_time_s >= max(t)
    # giving the slow pipeline less work makes the iteration faster
    lighter = plan_of([(0, 3, [rep(), rep(gpu="G2")])], [(2, 5), (2, 1)])
    assert simulate(lighter, book).iteration_time_s < simulate(
        plan_of([(0, 3, [rep(), rep(gpu="G2")])], [(2, 3), (2, 3)]), book).iteration_time_s


def test_straggler_replica_delays_the_stage_sync() -> None:
    book = make_book()
    even = plan_of([(0, 3, [rep(), rep()])], [(2, 3), (2, 3)])
    strag = plan_of([(0, 3, [rep(), rep(gpu="G2")])], [(2, 3), (2, 3)])
    assert simulate(strag, book).iteration_time_s > simulate(even, book).iteration_time_s


# --- bad input ------------------------------------------------------------------------------------


def test_missing_profile_names_the_key_and_the_command() -> None:
    book = make_book()
    plan = plan_of([(0, 3, [rep()])], [(8, 1)])
    with pytest.raises(MissingProfileError) as e:
        simulate(plan, book)
    msg = str(e.value)
    assert "model=tiny" in msg and "gpu_type=G1" in msg and "mbs=8" in msg and "tp=1" in msg
    assert "sailor profile" in msg


def test_invalid_plan_lists_every_violation() -> None:
    with pytest.raises(ValidationError) as e:  # the plan's shape: refused on construction
        ParallelPlan(
            model="tiny",
            global_batch_size=100,
            stages=(Stage(first_layer=0, last_layer=1, replicas=(rep(tp=4),)),
                    Stage(first_layer=3, last_layer=3, replicas=(rep(), rep()))),
            pipelines=(PipelineBatch(microbatch_size=1, num_microbatches=2),),
        )
    msg = str(e.value)
    for part in ("stage 1 starts at layer 3", "stage 1 has 2 replicas", "tp=4 is larger than a node",
                 "global_batch_size is 100"):
        assert part in msg
    short = plan_of([(0, 1, [rep()]), (2, 2, [rep()])], [(1, 2)])  # the model has layers 0..3
    with pytest.raises(PlanInvalidError) as pe:
        simulate(short, make_book(), options=SimOptions(schedule="zigzag"))
    assert "stages cover layers 0..2" in str(pe.value) and "schedule must be" in str(pe.value)


def test_model_for_is_shared_per_book() -> None:
    book = make_book()
    assert model_for(book) is model_for(book)
    assert model_for(dataclasses.replace(book)) is not model_for(book)


def test_stages_sharing_a_node_send_over_the_intra_node_link() -> None:
    book = make_book(inter_gbps=1.0, intra_gbps=100.0)
    shared = simulate(plan_of([(0, 1, [rep()]), (2, 3, [rep()])], [(2, 4)]), book)  # both on one 2-GPU node
    apart = simulate(plan_of([(0, 1, [rep(gpn=1)]), (2, 3, [rep(gpn=1)])], [(2, 4)]), book)
    msg = 64 * 2 * 4
    # fill: 2 sends; steady state: 3 more cycles of the gating stage, which pays the boundary once
    # each (activation and gradient cross at once)
    assert shared.breakdown.pipeline_p2p_s == pytest.approx((2 + 3) * msg / 100e9)
    assert apart.breakdown.pipeline_p2p_s == pytest.approx((2 + 3) * msg / 1e9)
    assert shared.iteration_time_s < apart.iteration_time_s
