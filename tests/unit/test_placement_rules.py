"""place(): the placement rules, one table case each."""

from __future__ import annotations

from typing import Any

import pytest
from drs_devcluster.profiles import build_nodes
from drs_operator.api import DisaggReplicaSetSpec, TopologySpec
from drs_operator.layout import engine_url, frontend_urls, replica_statuses
from drs_operator.nodepool import nodes_from_manifests, pod_gpus
from drs_operator.placement import NodeInfo, Placement, place, previous_from_status
from drs_operator.plan import Plan, plan

REFERENCE: dict[str, Any] = {
    "replicas": 2,
    "model": {"path": "/m"},
    "prefill": {"engines": 1, "tensorParallelSize": 4, "moeTensorParallelSize": 2, "moeExpertParallelSize": 2},
    "decode": {"engines": 2, "tensorParallelSize": 2, "moeTensorParallelSize": 1, "moeExpertParallelSize": 2},
    "frontend": {"workers": 2, "basePort": 8300},
}


def make_plan(**changes: Any) -> Plan:
    return plan(DisaggReplicaSetSpec.model_validate({**REFERENCE, **changes}), "drs")


def node(
    name: str, size: int, free: int | None = None, segment: str | None = None, address: str | None = None
) -> NodeInfo:
    return NodeInfo(name, size, size if free is None else free, segment or name, address=address)


def engine_nodes(p: Placement, replica: int) -> list[tuple[str, ...]]:
    return [e.nodes for e in p.replica(replica).engines]


def test_the_reference_layout_on_8_gpu_nodes_puts_each_replica_on_one_node() -> None:
    p = place(make_plan(), nodes_from_manifests(build_nodes("hgx", 4)))
    assert p.complete and not p.split
    assert engine_nodes(p, 0) == [("hgx-000",)] * 3 and engine_nodes(p, 1) == [("hgx-001",)] * 3
    assert [f.node for f in p.replica(1).frontends] == ["hgx-001", "hgx-001"]
    assert p.replica(0).segment == "hgx-000", "an unlabelled node is its own segment"


def test_the_reference_layout_on_4_gpu_nodes_keeps_each_replica_in_one_clique() -> None:
    p = place(make_plan(), nodes_from_manifests(build_nodes("gb200", 18)))
    assert p.complete and not p.split
    assert engine_nodes(p, 0) == [("gb200-000",), ("gb200-001",), ("gb200-001",)]
    assert engine_nodes(p, 1) == [("gb200-002",), ("gb200-003",), ("gb200-003",)]
    assert p.replica(0).segment == p.replica(1).segment == "nvl72-0"
    assert [f.node for f in p.replica(0).frontends] == ["gb200-000", "gb200-001"], (
        "frontends round-robin over the replica's nodes"
    )


def test_widths_that_do_not_tile_the_nodes_are_rejected_naming_the_boundary() -> None:
    p = place(make_plan(replicas=3), [node(f"n{i}", 6) for i in range(4)])
    assert not any(r.placed for r in p.replicas)
    assert all("node boundary at GPU 18" in why for _, why in p.excluded) and len(p.excluded) == 4
    assert all(r.reason and "no node is usable" in r.reason and "GPU 18" in r.reason for r in p.replicas)


def test_tp16_engines_on_8_gpu_nodes_take_whole_nodes_inside_one_clique() -> None:
    layout = make_plan(
        replicas=1,
        prefill={"engines": 1, "tensorParallelSize": 16},
        decode={"engines": 2, "tensorParallelSize": 8},
    )
    nodes = [node("a-0", 8, free=6, segment="a")] + [node(f"a-{i}", 8, segment="a") for i in (1, 2, 3)]
    nodes += [node(f"b-{i}", 8, segment="b") for i in range(4)]
    p = place(layout, nodes)
    assert p.complete and not p.split
    assert engine_nodes(p, 0) == [("b-0", "b-1"), ("b-2",), ("b-3",)], "clique a lacks a second free 8-GPU node"
    assert p.replica(0).segment == "b"


def test_tp16_without_segment_labels_is_not_placed_and_says_why() -> None:
    layout = make_plan(
        replicas=1, prefill={"engines": 1, "tensorParallelSize": 16}, decode={"engines": 1, "tensorParallelSize": 8}
    )
    p = place(layout, nodes_from_manifests(build_nodes("hgx", 4)))
    (r,) = p.replicas
    assert not r.placed and r.reason is not None
    assert "drs-r0-prefill-0 (width 16) needs whole free nodes of one segment" in r.reason


def test_a_gb200_replica_stays_inside_one_clique_when_room_exists() -> None:
    nodes = [node("x-0", 4, 0, "x"), node("x-1", 4, 4, "x"), node("y-0", 4, 4, "y"), node("y-1", 4, 4, "y")]
    p = place(make_plan(replicas=1), nodes)
    assert p.complete and not p.replica(0).split and p.replica(0).segment == "y"


def test_a_gb200_replica_is_split_across_cliques_with_a_reason_when_no_clique_has_room() -> None:
    nodes = [node("x-0", 4, 0, "x"), node("x-1", 4, 4, "x"), node("y-0", 4, 4, "y"), node("y-1", 4, 0, "y")]
    p = place(make_plan(replicas=1), nodes)
    r = p.replica(0)
    assert r.placed and r.split and r.segment is None and r.segments == ("x", "y")
    assert r.reason is not None and "split across 2 segments (x, y)" in r.reason
    assert engine_nodes(p, 0) == [("x-1",), ("y-0",), ("y-0",)]


def test_after_a_node_is_lost_only_the_replica_on_it_moves() -> None:
    layout = make_plan(replicas=3)
    before = place(layout, [node(f"n{i}", 8) for i in range(4)])
    assert [r.nodes for r in before.replicas] == [("n0",), ("n1",), ("n2",)]
    after = place(layout, [node("n0", 8), node("n2", 8), node("n3", 8)], previous=before)
    assert [r.nodes for r in after.replicas] == [("n0",), ("n3",), ("n2",)]


def test_a_placed_replica_stays_put_even_when_a_tighter_fit_appears() -> None:
    layout = make_plan(replicas=1)
    before = place(layout, [node("n0", 8, free=0), node("n1", 8)])
    after = place(layout, [node("n0", 8), node("n1", 8)], previous=before)
    assert after == before and after.replica(0).nodes == ("n1",)


def test_a_cordoned_node_moves_its_replica() -> None:
    layout = make_plan(replicas=1)
    before = place(layout, [node("n0", 8), node("n1", 8)])
    cordoned = NodeInfo("n0", 8, 8, "n0", schedulable=False, unschedulable_reason="cordoned")
    after = place(layout, [cordoned, node("n1", 8)], previous=before)
    assert after.replica(0).nodes == ("n1",) and after.excluded == (("n0", "cordoned"),)


def test_gpus_used_by_other_pods_are_respected_and_ours_are_not_counted() -> None:
    manifests = build_nodes("hgx", 3)
    pods = [
        gpu_pod("other", "hgx-000", 4),
        gpu_pod("ours", "hgx-001", 8, labels={"disagg.dev/replicaset": "drs"}),
        gpu_pod("done", "hgx-002", 8, phase="Succeeded"),
    ]
    nodes = nodes_from_manifests(manifests, pods, owner=("ns", "drs"))
    assert [n.free for n in nodes] == [4, 8, 8]
    p = place(make_plan(), nodes)
    assert [r.nodes for r in p.replicas] == [("hgx-001",), ("hgx-002",)]


def test_a_replica_that_cannot_be_placed_whole_gets_nothing_and_names_the_shortfall() -> None:
    p = place(make_plan(replicas=3), [node("n0", 8), node("n1", 8), node("n2", 8, free=4)])
    r = p.replica(2)
    assert not r.placed and all(e.nodes == () for e in r.engines) and all(f.node is None for f in r.frontends)
    assert r.reason is not None
    assert r.reason.startswith("replica 2 needs 8 GPUs in one node or segment")
    assert "largest free: 4 on node n2" in r.reason
    assert p.replica(0).placed and p.replica(1).placed


def test_frontends_go_round_robin_over_the_replicas_nodes() -> None:
    p = place(make_plan(replicas=1, frontend={"workers": 3}), [node(f"g{i}", 4, segment="c") for i in range(2)])
    assert [f.node for f in p.replica(0).frontends] == ["g0", "g1", "g0"]


def test_top_level_gpus_per_node_excludes_nodes_of_another_size() -> None:
    layout = make_plan(topology={"gpusPerNode": 4})
    p = place(layout, nodes_from_manifests(build_nodes("mixed", 8)))
    assert p.complete and all(n.startswith("gb200") for r in p.replicas for n in r.nodes)
    assert {n for n, _ in p.excluded} == {f"hgx-{i:03d}" for i in range(4)}


def test_no_nodes_at_all_leaves_every_replica_unplaced_with_a_reason() -> None:
    p = place(make_plan(), [])
    assert not p.complete and all(r.reason and "there are no nodes" in r.reason for r in p.replicas)


# --- node manifests -------------------------------------------------------------------------
def gpu_pod(
    name: str, node_name: str, gpus: int, labels: dict[str, str] | None = None, phase: str = "Running"
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "labels": labels or {}},
        "spec": {
            "nodeName": node_name,
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
        },
        "status": {"phase": phase},
    }


def test_a_pods_gpus_are_the_larger_of_its_containers_and_its_largest_init_container() -> None:
    pod = {
        "spec": {
            "containers": [
                {"resources": {"requests": {"nvidia.com/gpu": "2"}}},
                {"resources": {"limits": {"nvidia.com/gpu": 1}}},
            ],
            "initContainers": [{"resources": {"requests": {"nvidia.com/gpu": "4"}}}],
        }
    }
    assert pod_gpus(pod) == 4


@pytest.mark.parametrize(
    ("change", "topology", "reason"),
    [
        pytest.param(
            {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletDown"}]}},
            {},
            "not Ready (KubeletDown)",
            id="a NotReady node is not used",
        ),
        pytest.param(
            {"spec": {"unschedulable": True}}, {}, "cordoned (spec.unschedulable)", id="a cordoned node is not used"
        ),
        pytest.param(
            {},
            {"nodeSelector": {"pool": "rollout"}},
            "does not match topology.nodeSelector pool=rollout",
            id="a node outside the selector is not used",
        ),
        pytest.param(
            {"spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}},
            {},
            "taint nvidia.com/gpu=:NoSchedule is not tolerated",
            id="an untolerated taint keeps us off",
        ),
        pytest.param(
            {"spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]}},
            {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}]},
            None,
            id="a tolerated taint does not",
        ),
        pytest.param(
            {"spec": {"taints": [{"key": "x", "effect": "PreferNoSchedule"}]}},
            {},
            None,
            id="a PreferNoSchedule taint does not",
        ),
    ],
)
def test_schedulability(change: dict[str, Any], topology: dict[str, Any], reason: str | None) -> None:
    (manifest,) = build_nodes("hgx", 1)
    for key, value in change.items():
        manifest[key] = {**manifest.get(key, {}), **value}
    (info,) = nodes_from_manifests([manifest], topology=TopologySpec.model_validate(topology))
    assert info.schedulable == (reason is None) and info.unschedulable_reason == reason
    assert (info.allocatable, info.free, info.address) == (8, 8, "127.0.1.1")


def test_the_segment_is_the_segment_label_or_the_node_itself() -> None:
    infos = nodes_from_manifests(build_nodes("mixed", 4))
    assert [(n.name, n.segment) for n in infos] == [
        ("hgx-000", "hgx-000"),
        ("hgx-001", "hgx-001"),
        ("gb200-000", "nvl72-0"),
        ("gb200-001", "nvl72-0"),
    ]
    custom = nodes_from_manifests(build_nodes("hgx", 1), topology=TopologySpec(segment_label="kubernetes.io/os"))
    assert custom[0].segment == "linux"


# --- URLs and status ------------------------------------------------------------------------
def test_urls_with_pod_networking_are_service_names_known_before_placement() -> None:
    layout = make_plan()
    assert frontend_urls(layout, None, "ns", {}) == [
        "http://drs-r0-f0.ns.svc:8300",
        "http://drs-r0-f1.ns.svc:8301",
        "http://drs-r1-f0.ns.svc:8302",
        "http://drs-r1-f1.ns.svc:8303",
    ]
    assert engine_url(layout, layout.engines[0], None, "ns", {}) == "http://drs-r0-prefill-0.drs-engines.ns.svc:8000"


def test_urls_with_host_networking_name_the_placed_nodes_address() -> None:
    layout = make_plan(replicas=3, network={"hostNetwork": True}, frontend={"workers": 1, "basePort": 9000})
    nodes = [node("n0", 8, address="127.0.1.1"), node("n1", 8, address="127.0.1.2")]
    p = place(layout, nodes)
    assert frontend_urls(layout, p, "ns", {"n0": "127.0.1.1", "n1": "127.0.1.2"}) == [
        "http://127.0.1.1:9000",
        "http://127.0.1.2:9001",
        None,
    ]
    assert engine_url(layout, layout.engines[4], "n1", "ns", {"n1": "127.0.1.2"}) == "http://127.0.1.2:8004"


def test_the_status_shape_round_trips_into_the_sticky_input() -> None:
    layout = make_plan(replicas=3)
    nodes = [node("n0", 8), node("n1", 8)]
    first = place(layout, nodes)
    statuses = replica_statuses(layout, first, "ns", {})
    assert [s.placed for s in statuses] == [True, True, False] and statuses[2].reason
    assert statuses[0].frontends[1].url == "http://drs-r0-f1.ns.svc:8301" and statuses[0].engines[0].node == "n0"
    again = place(layout, [*nodes, node("n2", 8)], previous=previous_from_status(statuses))
    assert [r.nodes for r in again.replicas] == [("n0",), ("n1",), ("n2",)]
