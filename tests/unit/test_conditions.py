"""compute_status: conditions, phase, readiness and the Events of transitions, without a cluster."""

from __future__ import annotations

import dataclasses
import datetime

from drs_devcluster.profiles import build_nodes
from drs_operator.api.status import DisaggReplicaSetStatus
from drs_operator.conditions import Observed, compute_status, status_dict
from drs_operator.decide import decide
from drs_operator.nodepool import nodes_from_manifests
from drs_operator.validation import Problem
from operator_fixtures import OWNER, as_live, hgx, spec

T0 = datetime.datetime(2026, 11, 30, 12, 0, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def observe(ready: bool, nodes: int = 4, generation: int = 1) -> Observed:
    """What the operator's own pass (``decide``) observes once the children exist (ready or not)."""
    first = decide(spec(), OWNER, DisaggReplicaSetStatus(), hgx(nodes), {}, generation=generation)
    live = as_live(first.desired, ready=ready)
    return decide(spec(), OWNER, DisaggReplicaSetStatus(), hgx(nodes), live, generation=generation).observed


def cond(status: DisaggReplicaSetStatus, type_: str) -> tuple[str, str]:
    c = next(c for c in status.conditions if c.type == type_)
    return str(c.status), c.reason


def test_a_ready_fleet_is_ready_placed_valid_not_progressing_not_degraded() -> None:
    status, notes = compute_status("fleet", DisaggReplicaSetStatus(), observe(ready=True), T0)
    assert status.phase == "Ready" and status.ready_replicas == status.replicas == 2
    assert cond(status, "Ready") == ("True", "AllReplicasReady")
    assert cond(status, "Placed") == ("True", "AllReplicasPlaced")
    assert cond(status, "Progressing") == ("False", "Reconciled")
    assert cond(status, "Degraded") == ("False", "NotDegraded")
    assert all(e.ready for r in status.replica_statuses for e in r.engines)
    assert status.urls == [f"http://fleet-r{r}-f{f}.ns.svc:{8300 + 2 * r + f}" for r in range(2) for f in range(2)]
    assert {n.reason for n in notes} >= {"AllReplicasReady", "SpecValid"}


def test_an_unchanged_status_keeps_its_transition_times_and_emits_no_event() -> None:
    first, _ = compute_status("fleet", DisaggReplicaSetStatus(), observe(ready=True), T0)
    again, notes = compute_status("fleet", first, observe(ready=True), T1)
    assert notes == []
    assert status_dict(again) == status_dict(first)
    assert all(c.last_transition_time == T0 for c in again.conditions)


def test_pods_not_ready_yet_mean_progressing_not_ready() -> None:
    status, _ = compute_status("fleet", DisaggReplicaSetStatus(), observe(ready=False), T0)
    assert status.phase == "Progressing" and status.ready_replicas == 0
    assert cond(status, "Ready") == ("False", "ReplicasNotReady")
    assert cond(status, "Progressing")[0] == "True"


def test_a_replica_without_room_makes_placed_false_with_the_shortfall_and_degraded() -> None:
    status, notes = compute_status("fleet", DisaggReplicaSetStatus(), observe(ready=True, nodes=1), T0)
    placed = next(c for c in status.conditions if c.type == "Placed")
    assert placed.status == "False" and "replica 1" in placed.message and "GPUs" in placed.message
    assert status.replicas == 2 and status.ready_replicas == 1
    assert any(n.type == "Warning" and n.reason == "ReplicasUnplaced" for n in notes)


def test_an_invalid_spec_flips_valid_once_and_names_the_field() -> None:
    ready, _ = compute_status("fleet", DisaggReplicaSetStatus(), observe(ready=True), T0)
    problem = Problem("spec.topology.gpusPerNode", "engine widths 4, 4 do not tile 6-GPU nodes")
    invalid, notes = compute_status("fleet", ready, Observed(generation=2, problems=[problem]), T1)
    assert invalid.phase == "Invalid" and invalid.observed_generation == 2
    valid = next(c for c in invalid.conditions if c.type == "Valid")
    assert valid.status == "False" and valid.message.startswith("spec.topology.gpusPerNode: ")
    assert [n.type for n in notes] == ["Warning"]
    assert invalid.urls == ready.urls, "the published URLs survive a bad edit"
    _, again = compute_status("fleet", invalid, Observed(generation=2, problems=[problem]), T1)
    assert again == []


def test_the_sidecars_weights_annotation_becomes_status_weights_stamped_once() -> None:
    first, _ = compute_status(
        "fleet", DisaggReplicaSetStatus(), dataclasses.replace(observe(True), weights_version="step-7"), T0
    )
    assert first.weights is not None and (first.weights.version, first.weights.last_update_time) == ("step-7", T0)
    same, _ = compute_status("fleet", first, dataclasses.replace(observe(True), weights_version="step-7"), T1)
    assert same.weights == first.weights, "the same version keeps its time (no status write per resync)"
    newer, _ = compute_status("fleet", same, dataclasses.replace(observe(True), weights_version="step-8"), T1)
    assert newer.weights is not None and (newer.weights.version, newer.weights.last_update_time) == ("step-8", T1)
    unannotated, _ = compute_status("fleet", newer, observe(True), T1)
    assert unannotated.weights == newer.weights
    invalid, _ = compute_status(
        "fleet", newer, Observed(generation=2, problems=[Problem("spec.replicas", "bad")], weights_version="step-9"), T1
    )
    assert invalid.weights is not None and invalid.weights.version == "step-9", (
        "recorded even while the spec is invalid"
    )


def observe_wide(not_ready: frozenset[str] = frozenset()) -> Observed:
    """One replica: a TP8 prefill engine over two 4-GPU GB200 nodes (a gang of two pods), a TP4 decode."""
    nodes = nodes_from_manifests(build_nodes("gb200", 18))
    s = spec(
        replicas=1, prefill={"engines": 1, "tensorParallelSize": 8}, decode={"engines": 1, "tensorParallelSize": 4}
    )
    first = decide(s, OWNER, DisaggReplicaSetStatus(), nodes, {}, generation=1)
    live = as_live(first.desired, ready=True)
    for name in not_ready:
        live["Pod"][name]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    return decide(s, OWNER, DisaggReplicaSetStatus(), nodes, live, generation=1).observed


def test_an_engine_wider_than_a_node_lists_its_ranks_and_is_ready_only_as_a_whole() -> None:
    ready, _ = compute_status("fleet", DisaggReplicaSetStatus(), observe_wide(), T0)
    wide = ready.replica_statuses[0].engines[0]
    assert wide.ready and wide.ranks is not None
    assert [(r.rank, r.pod, r.joined) for r in wide.ranks] == [
        (0, "fleet-r0-prefill-0", True),
        (1, "fleet-r0-prefill-0-w1", True),
    ]
    assert [r.node for r in wide.ranks] == wide.nodes and len(set(wide.nodes)) == 2
    assert ready.replica_statuses[0].engines[1].ranks is None  # one pod: no rank list
    assert "ranks" not in status_dict(ready)["replicaStatuses"][0]["engines"][1]

    down, notes = compute_status("fleet", ready, observe_wide(frozenset({"fleet-r0-prefill-0-w1"})), T1)
    wide = down.replica_statuses[0].engines[0]
    assert not wide.ready and wide.ranks is not None
    assert [r.joined for r in wide.ranks] == [True, False]
    assert down.ready_replicas == 0
    gang = [n for n in notes if n.reason == "GangRestarting"]
    assert len(gang) == 1 and gang[0].type == "Warning"
    assert "fleet-r0-prefill-0-w1" in gang[0].message and "fleet-r0-prefill-0 " in gang[0].message

    again, notes = compute_status("fleet", down, observe_wide(), T1)
    assert again.replica_statuses[0].engines[0].ready
    assert [n.type for n in notes if n.reason == "GangReady"] == ["Normal"]
    _, quiet = compute_status("fleet", again, observe_wide(), T1)
    assert not [n for n in quiet if n.reason.startswith("Gang")]
