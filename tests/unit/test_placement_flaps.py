"""Placement while nodes flap: no node's GPUs are ever promised twice, and a NotReady blip does not
move a replica before ``topology.notReadyTolerationSeconds``.

The defect this module pins down: ``NodeInfo.free`` leaves our own pods out (a kept replica's
pods sit inside its own assignment), so a node still holding the pods of a replica that was
unplaced or moved (pods terminating there, or created by a pass whose status write was lost)
looked empty, and a moved replica was placed onto it: two replicas' engines pinned to one
node's GPUs. ``place(..., held=...)`` now takes what our live pods hold on nodes their replica is
not kept on; ``decide`` passes it from the live pods.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from drs_devcluster.profiles import build_nodes
from drs_operator.api.status import DisaggReplicaSetStatus
from drs_operator.decide import decide, held_by_replica
from drs_operator.layout import replica_statuses
from drs_operator.nodepool import nodes_from_manifests
from drs_operator.placement import NodeInfo, Placement, place, previous_from_status
from drs_operator.plan import Plan
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_fixtures import OWNER, as_live, build, spec
from test_placement_properties import demand, plans, pools

T0 = datetime.datetime(2026, 12, 1, 3, 0, tzinfo=datetime.UTC)
SETTINGS = settings(max_examples=300, deadline=None)
Live = dict[str, dict[str, dict[str, Any]]]


def width8(replicas: int = 2, **topology: Any) -> Any:
    """Replicas of width 8 (1 x TP4 prefill + 2 x TP2 decode): one per 8-GPU node."""
    return spec(replicas=replicas, topology=topology) if topology else spec(replicas=replicas)


def hgx_nodes(count: int, not_ready: dict[str, datetime.datetime] | None = None) -> list[dict[str, Any]]:
    """HGX Node manifests; ``not_ready`` maps a node to when its Ready condition turned False."""
    manifests = build_nodes("hgx", count)
    for m in manifests:
        since = (not_ready or {}).get(m["metadata"]["name"])
        if since is not None:
            m["status"]["conditions"] = [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "KubeletNotReady",
                    "lastTransitionTime": since.strftime("%Y-%m-%dT%H:%M:%SZ"),
                }
            ]
    return manifests


def status_of(s: Any, placement: Placement, nodes: list[NodeInfo]) -> DisaggReplicaSetStatus:
    """The status a pass would write (only the placement matters here)."""
    p, _, _ = build(s, nodes)
    return DisaggReplicaSetStatus(replica_statuses=replica_statuses(p, placement, OWNER.namespace, {}))


# --------------------------------------------------------------------------- the defect
def test_a_moved_replica_does_not_take_a_node_still_holding_an_unplaced_replicas_pods() -> None:
    s = width8()
    nodes = nodes_from_manifests(hgx_nodes(2))
    _, first, desired = build(s, nodes)
    assert [r.nodes for r in first.replicas] == [("hgx-000",), ("hgx-001",)]
    live = as_live(desired)
    # replica 1 was unplaced in the last status (its node blipped), but its pods are still on
    # hgx-001 (terminating, or created by a pass whose status write was lost)
    prior = status_of(s, dataclasses.replace(first, replicas=(first.replicas[0], _unplaced(first, 1))), nodes)
    # now hgx-000 goes away for good: replica 0 must move, and the only other node is hgx-001
    lost = nodes_from_manifests(hgx_nodes(2, {"hgx-000": T0 - datetime.timedelta(hours=1)}), now=T0)
    d = decide(s, OWNER, prior, lost, live, generation=1)
    r0 = d.placement.replica(0)
    assert not r0.placed, f"replica 0 placed onto hgx-001 while replica 1's pods hold its 8 GPUs: {r0.nodes}"
    # once replica 1's pods are gone, replica 0 takes hgx-001
    gone = {**live, "Pod": {k: v for k, v in live["Pod"].items() if "-r1-" not in k}}
    assert decide(s, OWNER, prior, lost, gone, generation=1).placement.replica(0).nodes == ("hgx-001",)


def _unplaced(p: Placement, index: int) -> Any:
    r = p.replica(index)
    engines = tuple(dataclasses.replace(e, nodes=()) for e in r.engines)
    return dataclasses.replace(r, placed=False, engines=engines, segments=(), reason="not placed")


def test_held_counts_bound_unfinished_engine_pods_per_node_and_replica() -> None:
    _, _, desired = build(width8(), nodes_from_manifests(hgx_nodes(2)))
    live = as_live(desired)["Pod"]
    assert held_by_replica(live) == {"hgx-000": {0: 8}, "hgx-001": {1: 8}}
    failed = {k: {**v, "status": {"phase": "Failed"}} if k.startswith("fleet-r1-") else v for k, v in live.items()}
    assert held_by_replica(failed) == {"hgx-000": {0: 8}}


@st.composite
def held(draw: st.DrawFn, nodes: list[NodeInfo], replicas: int) -> dict[str, dict[int, int]]:
    out: dict[str, dict[int, int]] = {}
    for n in nodes:
        for r in range(replicas + 1):  # one index past the plan: a replica scaled away
            if draw(st.integers(0, 3)) == 0:
                out.setdefault(n.name, {})[r] = draw(st.integers(1, n.allocatable))
    return out


def _kept(before: Placement | None, after: Placement, index: int) -> bool:
    if before is None:
        return False
    old = next((r for r in before.replicas if r.index == index and r.placed), None)
    return old is not None and old.engines == after.replica(index).engines


@SETTINGS
@given(plans(), pools(), st.data())
def test_a_replica_placed_anew_never_shares_gpus_with_pods_other_replicas_still_hold(
    layout: Plan, nodes: list[NodeInfo], data: st.DataObject
) -> None:
    previous = place(layout, nodes) if data.draw(st.booleans()) else None
    flapped = [
        dataclasses.replace(n, schedulable=False, unschedulable_reason="x") if data.draw(st.booleans()) else n
        for n in nodes
    ]
    strays = data.draw(held(nodes, len(layout.replicas)))
    p = place(layout, flapped, previous, strays)
    free = {n.name: n.free for n in flapped}
    used = demand(p, flapped)
    for r in p.replicas:
        if not r.placed or _kept(previous, p, r.index):
            continue
        for node in r.nodes:
            here = {r.index for r in p.replicas if node in r.nodes}
            others = sum(g for i, g in strays.get(node, {}).items() if i not in here)
            assert used[node] + others <= free[node], f"{node}: {used[node]} placed + {others} held > {free[node]}"


@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 5),
    st.lists(st.tuples(st.lists(st.booleans(), min_size=5, max_size=5), st.booleans()), min_size=2, max_size=8),
)
def test_the_operator_loop_never_double_books_a_node_while_nodes_flap(
    replicas: int, steps: list[tuple[list[bool], bool]]
) -> None:
    """The reconcile's own pure steps, pass after pass: nodes flip (toleration 0: moves at once),
    the pods follow the last decision (pods of replicas moved or unplaced linger one pass, as
    terminating pods do), and a pass's status write is sometimes lost. At every pass no node holds
    more GPUs than it has, counting what is placed there and what other replicas' pods still hold."""
    s = width8(replicas, notReadyTolerationSeconds=0)
    names = [f"hgx-{i:03d}" for i in range(5)]
    status = DisaggReplicaSetStatus()
    live: Live = {"Pod": {}}
    for up, status_lost in steps:
        down = {n: T0 for n, ok in zip(names, up, strict=True) if not ok}
        nodes = nodes_from_manifests(hgx_nodes(5, down), now=T0 + datetime.timedelta(seconds=1))
        d = decide(s, OWNER, status, nodes, live, generation=1)
        booked: dict[str, int] = {}
        for r in d.placement.replicas:
            for e in r.engines:
                for n in e.nodes:
                    booked[n] = booked.get(n, 0) + e.width
        for node, by_replica in held_by_replica(live["Pod"]).items():
            for i, gpus in by_replica.items():
                placed_here = i < len(d.placement.replicas) and node in d.placement.replica(i).nodes
                if not placed_here:
                    booked[node] = booked.get(node, 0) + gpus
        assert all(gpus <= 8 for gpus in booked.values()), f"double-booked: {booked}"
        # the pods follow: desired pods exist on their node; others linger one pass
        desired = as_live(d.desired)["Pod"]
        lingering = {k: v for k, v in live["Pod"].items() if k not in desired and not v.get("lingered")}
        for v in lingering.values():
            v["lingered"] = True
        kept = {k: live["Pod"][k] if _same_node(live["Pod"].get(k), v) else v for k, v in desired.items()}
        live = {"Pod": {**lingering, **kept}}
        if not status_lost:
            status = DisaggReplicaSetStatus(replica_statuses=d.observed.replica_statuses)


def _same_node(a: dict[str, Any] | None, b: dict[str, Any]) -> bool:
    return a is not None and a["spec"].get("nodeName") == b["spec"].get("nodeName")


# --------------------------------------------------------------------------- the toleration
def test_a_not_ready_node_keeps_its_replica_until_the_toleration_ends_and_takes_no_new_one() -> None:
    s = width8(replicas=2)
    nodes = nodes_from_manifests(hgx_nodes(3))
    _, first, _ = build(s, nodes)
    prior = previous_from_status(status_of(s, first, nodes).replica_statuses)
    blip = hgx_nodes(3, {"hgx-000": T0})
    within = nodes_from_manifests(blip, topology=s.topology, now=T0 + datetime.timedelta(seconds=299))
    node0 = next(n for n in within if n.name == "hgx-000")
    assert not node0.schedulable and node0.tolerated_until == T0 + datetime.timedelta(seconds=300)
    _, p, _ = build(s, within, prior)
    assert p.replica(0).nodes == ("hgx-000",), "moved during the toleration"
    assert "until 2026-12-01T03:05:00Z" in (p.replica(0).reason or "")
    assert "hgx-000" not in p.replica(1).nodes
    _, four, _ = build(width8(replicas=4), within, prior)
    assert four.replica(2).nodes == ("hgx-002",)
    assert not four.replica(3).placed, "a new replica went to the node that is not Ready"

    past = nodes_from_manifests(blip, topology=s.topology, now=T0 + datetime.timedelta(seconds=300))
    assert all(n.tolerated_until is None for n in past)
    _, moved, _ = build(s, past, prior)
    assert moved.replica(0).nodes == ("hgx-002",)


def test_toleration_zero_moves_at_once_and_without_now_nothing_is_tolerated() -> None:
    blip = hgx_nodes(2, {"hgx-000": T0})
    zero = width8(notReadyTolerationSeconds=0)
    assert all(n.tolerated_until is None for n in nodes_from_manifests(blip, topology=zero.topology, now=T0))
    assert all(n.tolerated_until is None for n in nodes_from_manifests(blip))  # drs plan: no clock
    assert width8().topology.not_ready_toleration_seconds == 300


def test_lingering_lifecycle_taints_on_a_ready_node_are_tolerated_but_other_problems_are_not() -> None:
    base = build_nodes("hgx", 1)[0]
    added = (T0 - datetime.timedelta(seconds=20)).strftime("%Y-%m-%dT%H:%M:%SZ")
    taint = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": added}
    tainted = {**base, "spec": {"taints": [taint]}}
    (n,) = nodes_from_manifests([tainted], now=T0)
    assert not n.schedulable and n.tolerated_until == T0 + datetime.timedelta(seconds=280)
    blip = hgx_nodes(1, {"hgx-000": T0})[0]
    cordoned = {**blip, "spec": {"unschedulable": True}}
    other = {**blip, "spec": {"taints": [{"key": "gpu-broken", "effect": "NoSchedule"}]}}
    for manifest in (cordoned, other):
        (m,) = nodes_from_manifests([manifest], now=T0)
        assert m.tolerated_until is None, manifest["spec"]


def test_decide_says_when_to_look_again_and_does_not_count_a_tolerated_node_as_lost() -> None:
    s = width8(replicas=2)
    nodes = nodes_from_manifests(hgx_nodes(3))
    _, first, desired = build(s, nodes)
    live = as_live(desired)
    blip = nodes_from_manifests(hgx_nodes(3, {"hgx-000": T0}), topology=s.topology, now=T0)
    d = decide(s, OWNER, status_of(s, first, nodes), blip, live, generation=1)
    assert d.tolerated_until == T0 + datetime.timedelta(seconds=300)
    assert d.moved == [] and not [a for a in d.rollout.actions if a.verb == "delete"]
