"""The status tells the truth about the pods, at every step of any sequence of pod states.

A hypothesis property drives sequences of live states (each engine pod missing, outdated or
current, ready or not, terminating; each frontend Deployment likewise) through ``compute_status``,
each step starting from the previous step's status, and checks the invariants the trainer and a
person rely on: ``Ready`` only when every child of the current spec is ready, ``readyReplicas``
equal to the replicas that really serve (at any spec hash), the phase consistent with the
conditions, and transition times that move only on a flip. Then the failure reasons, the weights
split and the URLs of unplaced replicas, by example.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import json
from typing import Any

import pytest
from drs_operator.api.names import STANDBY_SUFFIX
from drs_operator.api.status import DisaggReplicaSetStatus
from drs_operator.conditions import Observed, compute_status
from drs_operator.manifests.common import SPEC_HASH_ANNOTATION
from drs_operator.rollout import compute_actions
from drs_protocol.weights_digest import digest_bytes
from drs_protocol.weights_state import HeldWeights, dump_engine_weights, parse_engine_weights
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_fixtures import OWNER, as_live, observed_fleet

T0 = datetime.datetime(2026, 11, 30, 12, 0, tzinfo=datetime.UTC)
POD_STATES = ("missing", "outdated-ready", "outdated-unready", "current-ready", "current-unready", "terminating")
DEPLOYMENT_STATES = ("missing", "outdated-ready", "outdated-unready", "current-ready", "current-unready")
Live = dict[str, dict[str, dict[str, Any]]]


DESIRED, BASE = observed_fleet()
POD_NAMES = sorted(DESIRED.all_of("Pod"))
DEPLOYMENT_NAMES = sorted(DESIRED.all_of("Deployment"))


def live_state(pods: dict[str, str], deployments: dict[str, str]) -> Live:
    live = as_live(DESIRED, ready=True)
    for name, state in pods.items():
        pod = live["Pod"][name]
        if state == "missing":
            del live["Pod"][name]
            continue
        if state.startswith("outdated"):
            pod["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = "old"
        if state.endswith("unready"):
            pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        if state == "terminating":
            pod["metadata"]["deletionTimestamp"] = "2026-11-30T12:00:00Z"
    for name, state in deployments.items():
        dep = live["Deployment"][name]
        if state == "missing":
            del live["Deployment"][name]
            continue
        if state.startswith("outdated"):
            dep["metadata"]["annotations"][SPEC_HASH_ANNOTATION] = "old"
        if state.endswith("unready"):
            dep["status"]["readyReplicas"] = 0
    return live


def observe(live: Live) -> Observed:
    rollout = compute_actions(DESIRED, live, set(), [r.index for r in DESIRED.replicas])
    return dataclasses.replace(BASE, live=live, rollout=rollout)


def truly_serving(replica: int, pods: dict[str, str], deployments: dict[str, str]) -> bool:
    """Every engine pod ready, and each frontend URL served by one of its processes (the fleet
    runs a standby per URL: pod networking, ``frontend.standby`` unset)."""
    rc = next(r for r in DESIRED.replicas if r.index == replica)
    names = [d["metadata"]["name"] for d in rc.frontend_deployments]
    serving = {n.removesuffix(STANDBY_SUFFIX) for n in names if deployments[n] in ("outdated-ready", "current-ready")}
    urls = {n.removesuffix(STANDBY_SUFFIX) for n in names}
    engines = all(pods[p["metadata"]["name"]] in ("outdated-ready", "current-ready") for p in rc.engine_pods)
    return engines and serving == urls


def all_current_and_ready(pods: dict[str, str], deployments: dict[str, str]) -> bool:
    return all(v == "current-ready" for v in (*pods.values(), *deployments.values()))


states = st.fixed_dictionaries(
    {
        "pods": st.fixed_dictionaries({n: st.sampled_from(POD_STATES) for n in POD_NAMES}),
        "deployments": st.fixed_dictionaries({n: st.sampled_from(DEPLOYMENT_STATES) for n in DEPLOYMENT_NAMES}),
    }
)


@settings(max_examples=150, deadline=None)
@given(st.lists(states, min_size=1, max_size=6))
def test_status_agrees_with_the_pods_at_every_step_of_any_sequence(sequence: list[dict[str, Any]]) -> None:
    previous = DisaggReplicaSetStatus()
    for step, state in enumerate(sequence):
        now = T0 + datetime.timedelta(seconds=step)
        pods, deployments = state["pods"], state["deployments"]
        status, _ = compute_status(OWNER.name, previous, observe(live_state(pods, deployments)), now)
        conditions = {c.type: c for c in status.conditions}

        serving = [r for r in range(2) if truly_serving(r, pods, deployments)]
        assert status.ready_replicas == len(serving), "readyReplicas counts exactly the replicas that serve"
        assert [r.index for r in status.replica_statuses if r.ready] == serving
        assert status.updated_replicas <= status.ready_replicas
        ready = conditions["Ready"].status == "True"
        assert ready == all_current_and_ready(pods, deployments), "Ready iff every child of the spec is ready"
        if ready:
            assert status.ready_replicas == status.updated_replicas == 2
        is_phase_ready = status.phase == "Ready"
        assert is_phase_ready == (ready and conditions["Progressing"].status == "False")
        for c in status.conditions:
            old = next((o for o in previous.conditions if o.type == c.type), None)
            if old is not None and old.status == c.status:
                assert c.last_transition_time == old.last_transition_time
            elif old is not None:
                assert c.last_transition_time == now
        previous = status


def test_a_replica_serving_the_old_spec_while_another_rolls_counts_as_ready_but_not_updated() -> None:
    pods = {n: ("current-unready" if "-r0-" in n else "outdated-ready") for n in POD_NAMES}
    deployments = {n: ("current-ready" if "-r0-" in n else "outdated-ready") for n in DEPLOYMENT_NAMES}
    status, _ = compute_status(OWNER.name, DisaggReplicaSetStatus(), observe(live_state(pods, deployments)), T0)
    assert status.ready_replicas == 1 and status.updated_replicas == 0  # never 0 while replica 1 serves
    assert status.phase == "Progressing"
    assert next(c for c in status.conditions if c.type == "Ready").status == "False"


def _with_pod_status(name: str, pod_status: dict[str, Any]) -> Live:
    live = as_live(DESIRED, ready=True)
    live["Pod"][name]["status"] = pod_status
    return live


UNSCHEDULABLE = {
    "phase": "Pending",
    "conditions": [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": '0/4 nodes are available: persistentvolumeclaim "models" not found.',
        }
    ],
}
IMAGE_PULL = {
    "phase": "Pending",
    "conditions": [{"type": "Ready", "status": "False"}],
    "containerStatuses": [
        {
            "name": "engine",
            "ready": False,
            "state": {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "engine:nope"'}},
        }
    ],
}
CRASH_LOOP = {
    "phase": "Running",
    "conditions": [{"type": "Ready", "status": "False"}],
    "containerStatuses": [
        {
            "name": "engine",
            "ready": False,
            "restartCount": 4,
            "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
            "lastState": {"terminated": {"exitCode": 3, "reason": "Error"}},
        }
    ],
}


@pytest.mark.parametrize(
    ("pod_status", "reason", "words"),
    [
        pytest.param(UNSCHEDULABLE, "Unschedulable", 'persistentvolumeclaim "models" not found', id="missing-pvc"),
        pytest.param(IMAGE_PULL, "ImagePullBackOff", "engine:nope", id="image-pull"),
        pytest.param(CRASH_LOOP, "CrashLoopBackOff", "last exit 3 (Error)", id="crash-loop"),
    ],
)
def test_an_engine_pod_that_cannot_run_says_why_in_status_and_one_event(
    pod_status: dict[str, Any], reason: str, words: str
) -> None:
    name = POD_NAMES[0]
    live = _with_pod_status(name, copy.deepcopy(pod_status))
    status, notes = compute_status(OWNER.name, DisaggReplicaSetStatus(), observe(live), T0)
    engine = next(e for r in status.replica_statuses for e in r.engines if e.name == name)
    assert engine.problem == reason and words in (engine.message or "") and name in (engine.message or "")
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    progressing = next(c for c in status.conditions if c.type == "Progressing")
    assert (degraded.status, degraded.reason) == ("True", "PodsNotRunning")
    assert words in degraded.message and words in progressing.message
    assert status.phase == "Degraded"
    events = [n for n in notes if n.reason == "PodNotRunning"]
    assert len(events) == 1 and events[0].type == "Warning" and name in events[0].message
    _, notes_again = compute_status(OWNER.name, status, observe(live), T0 + datetime.timedelta(seconds=5))
    assert not [n for n in notes_again if n.reason == "PodNotRunning"], "one Event per cause, not per reconcile"


def test_engines_on_two_weights_versions_make_degraded_weights_split_until_they_agree() -> None:
    engines = [e.name for r in BASE.replica_statuses for e in r.engines]
    live = as_live(DESIRED, ready=True)
    split = {name: HeldWeights(version="step-2" if i else "step-1") for i, name in enumerate(engines)}
    status, notes = compute_status(
        OWNER.name, DisaggReplicaSetStatus(), dataclasses.replace(observe(live), engine_weights=split), T0
    )
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "WeightsSplit")
    assert "step-1" in degraded.message and engines[0] in degraded.message
    assert [e.weights_version for r in status.replica_statuses for e in r.engines] == [
        h.version for h in split.values()
    ]
    assert any(n.reason == "WeightsSplit" and n.type == "Warning" for n in notes)

    agreed = dict.fromkeys(engines, HeldWeights(version="step-2"))
    healed, _ = compute_status(OWNER.name, status, dataclasses.replace(observe(live), engine_weights=agreed), T0)
    degraded = next(c for c in healed.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("False", "NotDegraded")
    assert healed.phase == "Ready"


def test_the_same_version_with_other_bytes_is_a_weights_split_by_digest() -> None:
    engines = [e.name for r in BASE.replica_statuses for e in r.engines]
    live = as_live(DESIRED, ready=True)
    right, moved_nothing = digest_bytes(b"step-2 weights"), digest_bytes(b"step-1 weights")
    held = {n: HeldWeights(version="step-2", digest=moved_nothing if i == 0 else right) for i, n in enumerate(engines)}
    status, _ = compute_status(
        OWNER.name, DisaggReplicaSetStatus(), dataclasses.replace(observe(live), engine_weights=held), T0
    )
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert (degraded.status, degraded.reason) == ("True", "WeightsSplit")
    assert moved_nothing[:16] in degraded.message and engines[0] in degraded.message
    shown = [e.weights_digest for r in status.replica_statuses for e in r.engines]
    assert shown == [h.digest for h in held.values()]
    agreed = dict.fromkeys(engines, HeldWeights(version="step-2", digest=right))
    healed, _ = compute_status(OWNER.name, status, dataclasses.replace(observe(live), engine_weights=agreed), T0)
    assert next(c for c in healed.conditions if c.type == "Degraded").status == "False"


def test_the_engine_weights_annotation_is_read_leniently() -> None:
    digest = digest_bytes(b"w")
    annotation = json.dumps(
        {"a": "v1", "b": 3, "c": "", "d": {"version": "v2", "digest": digest}, "e": {"version": "v3", "digest": "x"}}
    )
    assert parse_engine_weights(annotation) == {
        "a": HeldWeights(version="v1"),
        "d": HeldWeights(version="v2", digest=digest),
    }
    assert parse_engine_weights("not json") == {}
    assert parse_engine_weights(json.dumps(["a"])) == {}
    assert parse_engine_weights(None) == {}
    held = {"b": HeldWeights(version="v1", digest=digest), "a": HeldWeights(version="v0")}
    assert parse_engine_weights(dump_engine_weights(held)) == held


def test_urls_of_an_unplaced_replica_are_empty_and_the_list_keeps_its_length() -> None:
    _, one_node = observed_fleet(nodes=1)
    status, _ = compute_status(OWNER.name, DisaggReplicaSetStatus(), one_node, T0)
    assert len(status.urls) == 4
    assert status.urls[:2] == ["http://fleet-r0-f0.ns.svc:8300", "http://fleet-r0-f1.ns.svc:8301"]
    assert status.urls[2:] == ["", ""]
