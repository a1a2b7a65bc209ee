"""Scenario files (infra/scenario.py): both forms parse, every problem is listed with where and how to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.scenario import ScenarioError, load_scenario, parse_scenario
from sailor_core.domain import Market

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def test_the_demo_scenario_is_one_local_zone_of_one_device_cpu_vms():
    sc = load_scenario(SCENARIOS / "demo.yaml")
    assert sc.zones == (("local", "local"),) and sc.regions == ("local",)
    assert {(o.gpu_type, o.gpus_per_vm, o.key) for o in sc.offerings} == {
        ("cpu", 1, "local/cpu/spot"), ("cpu", 1, "local/cpu/on-demand")}
    assert [d.cpu_per_device for d in sc.device_types] == [None]  # no quota: today's processes


def test_the_geo_scenario_has_zones_regions_device_types_and_vm_sizes():
    sc = load_scenario(SCENARIOS / "geo.yaml")
    assert len(sc.zones) >= 3 and len(sc.regions) >= 2
    assert {o.gpu_type for o in sc.offerings} == {"cpu-fast", "cpu-slow"}
    assert {o.gpus_per_vm for o in sc.offerings} >= {1, 2}
    assert {e.kind for e in sc.events} >= {"preemption", "price_change"}
    assert any(e.kind == "preemption" and e.market == Market.SPOT for e in sc.events)
    quota = {d.name: d.cpu_per_device for d in sc.device_types}
    assert quota["cpu-slow"] < quota["cpu-fast"]
    assert sum(o.gpus * (quota[o.gpu_type] or 0) for o in sc.offerings) <= 2.0
    # Links: same zone > same region > cross region.
    assert sc.link_gbps("eu-west", "eu-west") > sc.link_gbps("eu-west", "eu-north") > sc.link_gbps("eu-west", "us-east")


def test_link_defaults_and_pair_overrides():
    sc = parse_scenario({
        "device_types": {"g": {"cpu_per_device": 0.1}},
        "regions": {"r1": {"a": [{"device_type": "g", "count": 1, "usd_per_gpu_hour": 1}],
                           "b": [{"device_type": "g", "count": 1, "usd_per_gpu_hour": 1}]},
                    "r2": {"c": [{"device_type": "g", "count": 1, "usd_per_gpu_hour": 1}]}},
        "links": {"cross_region_gbps": 0.05, "pairs": [{"zones": ["c", "a"], "gbps": 0.02}]},
    })
    assert sc.link_gbps("a", "a") == 2.0 and sc.link_gbps("a", "b") == 0.5  # the defaults
    assert sc.link_gbps("b", "c") == 0.05 and sc.link_gbps("a", "c") == sc.link_gbps("c", "a") == 0.02
    assert sc.offerings[0].gpus_per_vm == 1 and sc.offerings[0].market == Market.ON_DEMAND


def test_every_problem_of_a_testbed_scenario_is_listed_with_its_place():
    with pytest.raises(ScenarioError) as e:
        parse_scenario({
            "device_types": {"fast": {"cpu_per_device": 1.5}, "slow": {"speed": 2}},
            "regions": {
                "eu": {"eu-a": [{"device_type": "fast", "devices_per_vm": 3, "count": 1, "usd_per_gpu_hour": 1},
                                {"device_type": "fast", "devices_per_vm": 2, "count": 1, "usd_per_gpu_hour": 1},
                                {"device_type": "fast", "devices_per_vm": 1, "count": 1, "usd_per_gpu_hour": 2},
                                {"device_type": "gpu9", "count": 1, "usd_per_gpu_hour": 1}]},
                "us": {"eu-a": [{"device_type": "slow", "count": 1, "usd_per_gpu_hour": 1}]},
            },
            "links": {"same_zone_gbps": 0, "pairs": [{"zones": ["eu-a", "mars"], "gbps": 1}]},
            "events": [{"at_step": 1, "kind": "capacity_change", "zone": "eu-a", "market": "on-demand", "count": 2},
                       {"at_step": 1, "kind": "preemption", "zone": "eu-b", "market": "spot"}],
        })
    msg = str(e.value)
    for part in [
        "device_types.slow: unknown keys ['speed']", "device_types.slow: needs cpu_per_device",
        "regions.eu.eu-a[0].devices_per_vm: must be one of 1, 2, 4, got 3",
        "regions.eu.eu-a: fast on on-demand listed twice in zone eu-a",
        "regions.eu.eu-a: device_type 'gpu9' is not under device_types",
        "regions.us.eu-a: zone eu-a is already in region eu",
        "links.same_zone_gbps: must be a number > 0", "links.pairs[0].zones: mars not among the zones",
        "device quotas: all offered VMs together may use 4.5 cores, more than cpu_budget_cores 2",
        "events[0]: a capacity_change must name exactly one offering",
        "events[1]: no offering with zone eu-b, market spot",
        "to fix: see scenarios/demo.yaml",
    ]:
        assert part in msg, part


def test_the_short_form_rejects_testbed_keys_and_both_forms_at_once():
    with pytest.raises(ScenarioError) as e:
        parse_scenario({"offerings": [{"market": "spot", "count": 1, "usd_per_gpu_hour": 1, "devices_per_vm": 2}],
                        "links": {}})
    assert "offerings[0]: unknown keys ['devices_per_vm']" in str(e.value)
    assert "links: only with regions" in str(e.value)
    with pytest.raises(ScenarioError, match="either offerings .* or regions"):
        parse_scenario({"offerings": [{"count": 1, "usd_per_gpu_hour": 1}],
                        "regions": {"r": {"z": [{"device_type": "cpu", "count": 1, "usd_per_gpu_hour": 1}]}},
                        "device_types": {"cpu": {"cpu_per_device": 0.1}}})


def test_events_narrow_by_zone_and_device_type_and_capacity_can_return():
    sc = load_scenario(SCENARIOS / "geo.yaml")
    pre = next(e for e in sc.events if e.kind == "preemption")
    assert [o.key for o in sc.offerings if pre.matches(o)] == ["eu-west/cpu-fast/spot"]
    back = parse_scenario({
        "device_types": {"g": {"cpu_per_device": 0.1}},
        "regions": {"r": {"z": [{"device_type": "g", "market": "spot", "count": 1, "usd_per_gpu_hour": 1}]}},
        "events": [{"at_s": 5, "kind": "capacity_change", "market": "spot", "count": 3}],
    }).events[0]
    assert back.vms == 3 and back.zone is None


def test_device_types_carry_their_memory_and_vm_size_to_the_store(tmp_path):
    from infra.local import LocalProvider

    sc = parse_scenario({
        "device_types": {"big": {"cpu_per_device": 0.2, "memory_gib": 2}, "small": {"cpu_per_device": 0.1}},
        "regions": {"r": {"z": [{"device_type": "big", "devices_per_vm": 2, "count": 1, "usd_per_gpu_hour": 1},
                                {"device_type": "small", "count": 1, "usd_per_gpu_hour": 1}]}},
    })
    types = {g.name: g for g in LocalProvider(tmp_path, scenario=sc).device_types()}
    assert types["big"].memory_bytes == 2 * 2**30 and types["big"].gpus_per_node == 2
    assert types["small"].memory_bytes == 8 * 2**30 and types["small"].gpus_per_node == 1
    with pytest.raises(ScenarioError, match="device_types.big.memory_gib: must be a number > 0"):
        parse_scenario({"device_types": {"big": {"cpu_per_device": 0.2, "memory_gib": 0}},
                        "regions": {"r": {"z": [{"device_type": "big", "count": 1, "usd_per_gpu_hour": 1}]}}})
