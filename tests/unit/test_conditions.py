"""compute_status: conditions, phase, readiness and the Events of transitions, without a cluster."""

from __future__ import annotations

import dataclasses
import datetime

from drs_operator.api.status import DisaggReplicaSetStatus
from drs_operator.conditions import Observed, compute_status, status_dict
from drs_operator.layout import frontend_urls, replica_statuses
from drs_operator.rollout import compute_actions
from drs_operator.validation import Problem
from operator_fixtures import OWNER, as_live, build, hgx, spec

T0 = datetime.datetime(2026, 11, 30, 12, 0, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


def observe(ready: bool, nodes: int = 4, generation: int = 1) -> Observed:
    s = spec()
    p, placement, desired = build(s, hgx(nodes))
    live = as_live(desired, ready=ready)
    addresses = {n.name: n.address or "" for n in hgx(nodes)}
    return Observed(
        generation=generation,
        replica_statuses=replica_statuses(p, placement, OWNER.namespace, addresses),
        urls=frontend_urls(p, placement, OWNER.namespace, addresses),
        replica_width=p.replica_width,
        gpus=p.gpus,
        desired=desired,
        live=live,
        rollout=compute_actions(desired, live, set(), [r.index for r in p.replicas]),
    )


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
