"""The flow's checkpoint interval (tasks/checkpointing.py): the user's, or Young/Daly's from what is known."""

from __future__ import annotations

import pytest

from sailor_core.domain import Market, Replica
from sailor_core.planner.risk import SpotRisk
from tasks.checkpointing import (
    ASSUMED_WRITE_BYTES_PER_S,
    interval_for,
    measured_checkpoint,
    notice_s,
    writer_state_bytes,
)
from tests.test_runtime import plan, rep


def test_the_notice_comes_from_the_user_the_cloud_or_the_scenario():
    assert notice_s("aws", None) == 120.0 and notice_s("gcp", None) == 30.0
    assert notice_s("aws", 45.0) == 45.0
    assert notice_s("local", None, [10.0, 2.0]) == 2.0 and notice_s("local", None) is None


def test_the_largest_writer_holds_its_stages_weights_and_two_moments():
    p = plan([((0, 1), [rep()]), ((2, 5), [rep(2)])])
    # gpt-tiny: hidden 128, FFN 512, vocabulary 256, 128 learned positions, biases, LayerNorm (2 x 128 each);
    # 12 B per parameter: fp32 weights and Adam's two moments.
    # stage 0 at tp 1: embedding 256*128 + 128*128 = 49,152; block 1: norms 512, attention 384*128 + 384 +
    #   128*128 + 128 = 66,048, MLP 128*512 + 512 + 512*128 + 128 = 131,712 -> 198,272; 247,424 x 12 = 2,969,088
    # stage 1 at tp 2: blocks 2-4 each 512 + 33,088 + 65,920 = 99,520; head 256 + 256*128/2 = 16,640;
    #   315,200 x 12 = 3,782,400: the larger writer
    assert writer_state_bytes(p) == 3_782_400


def test_measured_times_are_the_newest_records():
    rows = [{"step": 1}, {"step": 5, "checkpoint_write_s": 3.0, "checkpoint_stall_s": 0.2}, {"step": 6},
            {"step": 10, "checkpoint_write_s": 4.0, "checkpoint_stall_s": 0.3}]
    assert measured_checkpoint(rows) == {"write_s": 4.0, "stall_s": 0.3}
    assert measured_checkpoint([{"step": 1}]) is None


def test_given_interval_wins_and_auto_follows_the_rule():
    p = plan([((0, 5), [rep()])])
    assert interval_for(7, p, 0.5, total_steps=100, risk=SpotRisk(), notice=None).steps == 7
    # spot VMs at 3 preemptions per VM-hour, a 10 s notice, a measured 20 s write: the notice is too short
    spot = plan([((0, 5), [Replica(gpu_type="cpu", zone="local", tp=1, gpus_per_node=1, market=Market.SPOT)])])
    risky = SpotRisk(default_preemptions_per_vm_hour=3.0)
    short = interval_for(0, spot, 1.0, total_steps=10_000, risk=risky, notice=10.0,
                         measured={"write_s": 20.0, "stall_s": 0.5})
    long = interval_for(0, spot, 1.0, total_steps=10_000, risk=risky, notice=60.0,
                        measured={"write_s": 20.0, "stall_s": 0.5})
    # A checkpoint costs its 0.5 s stall plus the 19 s its write outlasts the next 1 s step (that step
    # commits only once the write is durable): sqrt(2 x 19.5 x 3600 / 3.0014) - 19.5 = 196.8 s.
    assert short.steps == 197 and "measured" in short.reason
    assert long.steps > 1000  # the notice covers a just-in-time checkpoint: only unnoticed failures count
    # A write shorter than a step costs only its stall: sqrt(2 x 0.5 x 3600 / 3.0014) - 0.5 = 34.1 s.
    fast = interval_for(0, spot, 1.0, total_steps=10_000, risk=risky, notice=1.0,
                        measured={"write_s": 0.8, "stall_s": 0.5})
    assert fast.steps == 34
    est = interval_for(0, spot, 1.0, total_steps=10_000, risk=risky, notice=None)
    assert "estimated" in est.reason
    assert est.steps >= writer_state_bytes(spot) / ASSUMED_WRITE_BYTES_PER_S  # never below one write


@pytest.mark.parametrize("given", [0, 3])
def test_the_flow_parameters_accept_auto_and_a_number(given):
    from flows.params import SailorParams

    p = SailorParams(model="gpt-tiny", global_batch_size=8, steps=10, checkpoint_interval=given)
    assert p.checkpoint_interval == given
