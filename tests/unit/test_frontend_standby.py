"""``spec.frontend.standby``: a second frontend process per URL — its manifests, the order in which
the two Deployments of a URL roll, the status of a URL served by either, and the request ids of
two processes under one node id. Frontend pods that cannot run reach the status as engines' do."""

from __future__ import annotations

import copy
import datetime
import json
from typing import Any

from drs_operator.api.constants import FRONTEND_PODS, LABEL_FRONTEND_PROCESS
from drs_operator.api.status import DisaggReplicaSetStatus
from drs_operator.conditions import compute_status
from drs_operator.decide import decide
from drs_operator.rollout import compute_actions
from drs_protocol.snowflake import EPOCH_MS, SnowflakeMinter, node_id_of
from hypothesis import given, settings
from hypothesis import strategies as st
from operator_fixtures import OWNER, as_live, build, hgx, spec

T0 = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)


def standby_spec(**frontend: Any) -> Any:
    return spec(frontend={"workers": 2, "basePort": 8300, "standby": True, **frontend})


def plain_spec(**overrides: Any) -> Any:
    """The same fleet with one process per URL (``standby: false``)."""
    return spec(frontend={"workers": 2, "basePort": 8300, "standby": False}, **overrides)


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_a_standby_is_a_second_deployment_of_the_url_with_process_id_1_behind_the_same_service() -> None:
    _, _, desired = build(standby_spec())
    deps = desired.all_of("Deployment")
    assert sorted(deps) == sorted(f"fleet-r{r}-f{f}{s}" for r in range(2) for f in range(2) for s in ("", "-standby"))
    primary, standby = deps["fleet-r1-f0"], deps["fleet-r1-f0-standby"]
    p_args = primary["spec"]["template"]["spec"]["containers"][0]["args"]
    s_args = standby["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--process-id" not in p_args and s_args[s_args.index("--process-id") + 1] == "1"
    assert [a for a in s_args if a not in ("--process-id", "1")] == p_args  # same port, same node id
    service = desired.all_of("Service")["fleet-r1-f0"]
    assert service["spec"]["sessionAffinity"] == "ClientIP"
    p_labels, s_labels = (
        primary["spec"]["template"]["metadata"]["labels"],
        standby["spec"]["template"]["metadata"]["labels"],
    )
    assert matches(service["spec"]["selector"], p_labels) and matches(service["spec"]["selector"], s_labels)
    assert matches(standby["spec"]["selector"]["matchLabels"], s_labels)
    assert not matches(standby["spec"]["selector"]["matchLabels"], p_labels)
    assert s_labels[LABEL_FRONTEND_PROCESS] == "1" and LABEL_FRONTEND_PROCESS not in p_labels


def test_without_a_standby_the_frontend_manifests_are_what_they_were() -> None:
    _, _, plain = build(plain_spec())
    _, _, with_standby = build(standby_spec())
    for name, dep in plain.all_of("Deployment").items():
        assert with_standby.all_of("Deployment")[name] == dep  # turning standby on restarts no frontend
    assert "sessionAffinity" not in plain.all_of("Service")["fleet-r0-f0"]["spec"]


def test_turning_standby_on_only_creates_the_standby_deployments() -> None:
    _, _, plain = build(plain_spec())
    _, _, desired = build(standby_spec())
    r = compute_actions(desired, as_live(plain), set(), [0, 1])
    deployment_actions = sorted((a.verb, a.name) for a in r.actions if a.kind == "Deployment")
    assert deployment_actions == [("create", f"fleet-r{i}-f{f}-standby") for i in range(2) for f in range(2)]


def test_unset_standby_is_on_with_pod_networking_and_off_on_the_host_network() -> None:
    _, _, unset = build(spec())
    _, _, standby = build(standby_spec())
    assert unset.all_of("Deployment") == standby.all_of("Deployment")  # an upgraded fleet gains standbys only
    host = spec(network={"hostNetwork": True})
    assert host.frontend_standby is False and plain_spec().frontend_standby is False
    _, _, on_host = build(host)
    assert not [n for n in on_host.all_of("Deployment") if n.endswith("-standby")]


def standby_condition(fleet: Any) -> Any:
    decision = decide(fleet, OWNER, DisaggReplicaSetStatus(), hgx(), {}, generation=1)
    status, notes = compute_status("fleet", DisaggReplicaSetStatus(), decision.observed, T0)
    assert not [n for n in notes if str(n.reason).startswith(("StandbyPer", "HostNetwork", "StandbyOff"))]  # not news
    return next(c for c in status.conditions if c.type == "FrontendStandby")


def test_the_frontend_standby_condition_says_what_a_killed_frontend_costs() -> None:
    on = standby_condition(spec())
    assert (on.status, on.reason) == ("True", "StandbyPerURL") and "4 frontend URL(s) runs two processes" in on.message
    host = standby_condition(spec(network={"hostNetwork": True}))
    assert (host.status, host.reason) == ("False", "HostNetworkOneProcessPerURL")
    assert host.message.startswith("network.hostNetwork: each frontend URL is one process") and "dark" in host.message
    off = standby_condition(plain_spec())
    assert (off.status, off.reason) == ("False", "StandbyOff") and off.message.startswith("frontend.standby is false")


def rolled_frontends() -> tuple[Any, Any]:
    """Live at standby spec, desired: the same with another frontend template (engines unchanged)."""
    _, _, old = build(standby_spec())
    _, _, new = build(standby_spec(holdSeconds=5))
    return old, new


def replaced(actions: Any) -> list[str]:
    return sorted(a.name for a in actions if a.kind == "Deployment" and a.verb == "replace")


def test_a_frontend_roll_replaces_process_0_first_while_its_standby_serves() -> None:
    old, new = rolled_frontends()
    live = as_live(old)
    assert replaced(compute_actions(new, live, set(), [0, 1]).actions) == [
        f"fleet-r{r}-f{f}" for r in range(2) for f in range(2)
    ]


def test_the_standby_is_replaced_only_once_process_0_serves_the_new_template() -> None:
    old, new = rolled_frontends()
    live = as_live(old)
    current = as_live(new)
    live["Deployment"]["fleet-r0-f0"] = copy.deepcopy(current["Deployment"]["fleet-r0-f0"])
    live["Deployment"]["fleet-r0-f0"]["status"]["readyReplicas"] = 0  # recreated, not ready yet
    first = replaced(compute_actions(new, live, set(), [0, 1]).actions)
    assert "fleet-r0-f0-standby" not in first
    live["Deployment"]["fleet-r0-f0"]["status"]["readyReplicas"] = 1
    assert "fleet-r0-f0-standby" in replaced(compute_actions(new, live, set(), [0, 1]).actions)


def test_process_0_waits_for_a_standby_that_is_coming_up_at_the_current_template() -> None:
    old, new = rolled_frontends()
    live = as_live(old)
    current = as_live(new)
    live["Deployment"]["fleet-r0-f0-standby"] = copy.deepcopy(current["Deployment"]["fleet-r0-f0-standby"])
    live["Deployment"]["fleet-r0-f0-standby"]["status"]["readyReplicas"] = 0
    assert "fleet-r0-f0" not in replaced(compute_actions(new, live, set(), [0, 1]).actions)


def test_a_standby_down_at_an_old_template_does_not_hold_process_0_back() -> None:
    old, new = rolled_frontends()
    live = as_live(old)
    live["Deployment"]["fleet-r0-f0-standby"]["status"]["readyReplicas"] = 0  # broken, outdated
    out = replaced(compute_actions(new, live, set(), [0, 1]).actions)
    assert "fleet-r0-f0" in out and "fleet-r0-f0-standby" in out


def observed(live: dict[str, Any], s: Any) -> Any:
    return decide(s, OWNER, DisaggReplicaSetStatus(), hgx(4), live, generation=1).observed


def test_a_url_whose_process_0_is_down_is_still_ready_through_its_standby() -> None:
    s = standby_spec()
    first = decide(s, OWNER, DisaggReplicaSetStatus(), hgx(4), {}, generation=1)
    live = as_live(first.desired)
    live["Deployment"]["fleet-r0-f1"]["status"]["readyReplicas"] = 0
    status, _ = compute_status("fleet", DisaggReplicaSetStatus(), observed(live, s), T0)
    f1 = status.replica_statuses[0].frontends[1]
    assert f1.ready and f1.standby_ready and not f1.updated
    assert status.ready_replicas == 2
    assert all(
        f.standby_ready is None
        for f in compute_status(
            "fleet", DisaggReplicaSetStatus(), observed(as_live(build(plain_spec())[2]), plain_spec()), T0
        )[0]
        .replica_statuses[0]
        .frontends
    )


def crash_looping_frontend_pod(name: str, replica: int, index: int) -> dict[str, Any]:
    return {
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": {
                "disagg.dev/replicaset": "fleet",
                "disagg.dev/role": "frontend",
                "disagg.dev/replica": str(replica),
                "disagg.dev/frontend": str(index),
            },
        },
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "frontend",
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 10s restarting"}},
                    "lastState": {"terminated": {"exitCode": 3, "reason": "Error"}},
                }
            ],
        },
    }


def test_a_crash_looping_frontend_pod_is_in_the_status_degraded_and_one_event() -> None:
    s = plain_spec()
    first = decide(s, OWNER, DisaggReplicaSetStatus(), hgx(4), {}, generation=1)
    live = as_live(first.desired)
    live["Deployment"]["fleet-r1-f0"]["status"]["readyReplicas"] = 0
    live[FRONTEND_PODS] = {"fleet-r1-f0-6c9f-abcde": crash_looping_frontend_pod("fleet-r1-f0-6c9f-abcde", 1, 0)}
    status, notes = compute_status("fleet", DisaggReplicaSetStatus(), observed(live, s), T0)
    f0 = status.replica_statuses[1].frontends[0]
    assert f0.problem == "CrashLoopBackOff" and not f0.ready
    assert f0.message is not None and "fleet-r1-f0-6c9f-abcde" in f0.message and "last exit 3" in f0.message
    assert status.phase == "Degraded"
    degraded = next(c for c in status.conditions if c.type == "Degraded")
    assert degraded.reason == "PodsNotRunning" and "fleet-r1-f0-6c9f-abcde" in degraded.message
    assert [n.reason for n in notes].count("PodNotRunning") == 1
    _, notes = compute_status("fleet", status, observed(live, s), T0)
    assert "PodNotRunning" not in [n.reason for n in notes]  # one Event per pod and cause


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 255), st.integers(0, 2**30))
def test_two_processes_under_one_node_id_never_mint_the_same_id(node_id: int, ms: int) -> None:
    """Both processes in the same millisecond (a frozen clock), each up to its 1024 ids of it."""
    minters = [SnowflakeMinter(node_id, p, clock_ms=lambda: EPOCH_MS + ms) for p in (0, 1)]
    ids = [m.next_id() for _ in range(1024) for m in minters]
    assert len(set(ids)) == len(ids) == 2048
    assert {node_id_of(i) for i in ids} == {node_id}


def test_a_frontend_pod_mounts_its_replicas_config_and_watches_it_for_new_fallback_pools() -> None:
    _, _, desired = build(spec())
    pod = desired.all_of("Deployment")["fleet-r1-f0"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == "fleet-r1-frontend-config"
    container = pod["containers"][0]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    args = container["args"]
    assert args[args.index("--config-watch") + 1] == f"{mount['mountPath']}/config.json"
    config = json.loads(desired.all_of("ConfigMap")["fleet-r1-frontend-config"]["data"]["config.json"])
    assert config["fallbackPrefill"]  # what the watch reads: the other replica's engines
