"""compute_actions: the decisions that move live children to the desired ones, without a cluster."""

from __future__ import annotations

from typing import Any

from drs_operator.rollout import Action, compute_actions
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_fixtures import as_live, build, hgx, spec


def verbs(actions: tuple[Action, ...]) -> list[tuple[str, str, str]]:
    return sorted((a.verb, a.kind, a.name) for a in actions)


def test_from_nothing_every_child_is_created_and_nothing_deleted() -> None:
    _, _, desired = build(spec())
    r = compute_actions(desired, {}, set(), [0, 1])
    assert {a.verb for a in r.actions} == {"create"}
    created = {(a.kind, a.name) for a in r.actions}
    for kind in ("Pod", "Deployment", "Service", "ConfigMap"):
        assert {(kind, n) for n in desired.all_of(kind)} <= created


def test_a_converged_fleet_needs_no_action() -> None:
    _, _, desired = build(spec())
    r = compute_actions(desired, as_live(desired), set(), [0, 1])
    assert r.actions == () and r.message == ""


def test_a_missing_engine_pod_is_recreated_and_nothing_else_is_touched() -> None:
    _, _, desired = build(spec())
    live = as_live(desired)
    del live["Pod"]["fleet-r1-decode-0"]
    r = compute_actions(desired, live, set(), [0, 1])
    assert verbs(r.actions) == [("create", "Pod", "fleet-r1-decode-0")]


def test_a_failed_engine_pod_is_deleted_at_once_so_it_comes_back() -> None:
    _, _, desired = build(spec())
    live = as_live(desired)
    live["Pod"]["fleet-r0-prefill-0"]["status"]["phase"] = "Failed"
    r = compute_actions(desired, live, set(), [0, 1])
    assert [(a.verb, a.name, a.grace_seconds, a.reason) for a in r.actions] == [
        ("delete", "fleet-r0-prefill-0", 0, "failed")
    ]
    del live["Pod"]["fleet-r0-prefill-0"]
    assert verbs(compute_actions(desired, live, set(), [0, 1]).actions) == [("create", "Pod", "fleet-r0-prefill-0")]


def changed_decode(replicas: int = 3) -> tuple[Any, Any]:
    _, _, old = build(spec(replicas=replicas))
    _, _, new = build(
        spec(replicas=replicas, decode={"engines": 2, "tensorParallelSize": 2, "gpuMemoryUtilization": 0.5})
    )
    return old, new


def test_a_spec_change_rolls_the_lowest_replica_first_and_the_others_wait() -> None:
    old, new = changed_decode()
    r = compute_actions(new, as_live(old), set(), [0, 1, 2])
    assert verbs(r.actions) == [
        ("delete", "Pod", "fleet-r0-decode-0"),
        ("delete", "Pod", "fleet-r0-decode-1"),
        ("replace", "ConfigMap", "fleet-decode-config"),  # read only by pods started from now on
    ]
    assert r.rolling == (0,) and r.waiting == (1, 2)
    assert "waiting" in r.message


def test_the_next_replica_waits_while_the_rolled_one_is_not_available_yet() -> None:
    old, new = changed_decode()
    live = as_live(old)
    current = as_live(new)
    for name in ("fleet-r0-decode-0", "fleet-r0-decode-1"):  # replica 0 rolled, its new pods not ready yet
        live["Pod"][name] = current["Pod"][name]
        live["Pod"][name]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    r = compute_actions(new, live, set(), [0, 1, 2])
    assert [a for a in r.actions if a.verb == "delete"] == []
    assert r.waiting == (1, 2)


def test_frontends_follow_their_engines_only_once_the_engines_are_current_and_ready() -> None:
    old, new = build(spec(replicas=1))[2], build(spec(replicas=1, router={"ctx": "round_robin"}))[2]
    live = as_live(old)
    r = compute_actions(new, live, set(), [0])
    assert {(a.verb, a.kind) for a in r.actions} == {("replace", "ConfigMap"), ("replace", "Deployment")}


def test_pods_on_a_lost_node_are_deleted_at_once_with_no_grace() -> None:
    _, before, old = build(spec())
    live = as_live(old)
    lost = live["Pod"]["fleet-r0-prefill-0"]["spec"]["nodeName"]
    nodes = [n for n in hgx(4) if n.name != lost]
    _, _, new = build(spec(), nodes, previous=before)
    r = compute_actions(new, live, {lost}, [0, 1])
    deletes = [a for a in r.actions if a.verb == "delete" and a.kind == "Pod"]
    assert deletes and all(a.grace_seconds == 0 and a.reason == "node lost" for a in deletes)
    assert {a.name.split("-")[1] for a in deletes} == {"r0"}


def test_scaling_down_deletes_whole_replicas_above_the_new_count() -> None:
    _, _, three = build(spec(replicas=3))
    _, _, one = build(spec(replicas=1))
    r = compute_actions(one, as_live(three), set(), [0])
    deletes = [a for a in r.actions if a.verb == "delete"]
    assert {a.replica for a in deletes} == {1, 2}
    assert {a.kind for a in deletes} == {"Pod", "Deployment", "Service", "ConfigMap"}
    # the one kept replica's frontend config loses its fallback engines; its pods are not touched
    others = [a for a in r.actions if a.verb != "delete"]
    assert [(a.verb, a.kind, a.replica) for a in others] == [("replace", "ConfigMap", 0)]


@settings(max_examples=60, deadline=None)
@given(
    replicas=st.integers(min_value=1, max_value=4),
    down=st.sets(st.integers(min_value=0, max_value=3)),
)
def test_a_pass_never_takes_down_a_second_available_replica(replicas: int, down: set[int]) -> None:
    old, new = changed_decode(replicas)
    live = as_live(old)
    for r in down & set(range(replicas)):  # these replicas are already unavailable
        live["Pod"][f"fleet-r{r}-prefill-0"]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    result = compute_actions(new, live, set(), list(range(replicas)))
    rolled_available = {a.replica for a in result.actions if a.verb == "delete"} - down
    already_down = down & set(range(replicas))
    assert len(rolled_available) <= (0 if already_down else 1)
