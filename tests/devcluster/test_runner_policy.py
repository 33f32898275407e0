"""The pod runner's decisions: which pods run, back-off, probes, status patches. Pure, no cluster."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from drs_devcluster.runner_policy import (
    BACKOFF_MAX_S,
    NOT_HOST_NETWORK_MESSAGE,
    STOP_GRACE_CAP_S,
    Action,
    ContainerRun,
    LastExit,
    Probe,
    ProbeSpecError,
    Readiness,
    classify,
    event_body,
    next_consecutive_exits,
    probe_succeeded,
    readiness_probe,
    restart_delay_s,
    status_patch,
    stop_grace_s,
    workdir_name,
)

NOW = "2026-01-01T00:00:10Z"


def kwok_pod(**spec: Any) -> dict[str, Any]:
    """A host-network drs pod as kwok leaves it: Running, Ready, with a host IP."""
    return {
        "metadata": {"name": "e-0", "namespace": "ns", "uid": "0123456789abcdef"},
        "spec": {
            "nodeName": "hgx-001",
            "hostNetwork": True,
            "containers": [{"name": "engine", "image": "drs/engine:dev", "command": ["drs", "engine"]}],
            **spec,
        },
        "status": {
            "phase": "Running",
            "hostIP": "127.0.1.2",
            "podIP": "127.0.1.2",
            "conditions": [
                {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ],
            "containerStatuses": [
                {
                    "name": "engine",
                    "image": "drs/engine:dev",
                    "imageID": "",
                    "lastState": {},
                    "ready": True,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}},
                }
            ],
        },
    }


def with_changes(pod: dict[str, Any], **paths: Any) -> dict[str, Any]:
    out = copy.deepcopy(pod)
    for path, value in paths.items():
        *parents, leaf = path.split("__")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return out


CLASSIFY_CASES = [
    ("a running host-network drs pod on a dev node runs", kwok_pod(), True, Action.RUN),
    ("a pod on a node that is not a dev node is not ours", kwok_pod(), False, Action.IGNORE),
    ("an unbound pod is not ours", with_changes(kwok_pod(), spec__nodeName=None), True, Action.IGNORE),
    (
        "a pod whose command is not drs is left to kwok",
        with_changes(kwok_pod(), spec__containers=[{"name": "x", "command": ["nginx"]}]),
        True,
        Action.IGNORE,
    ),
    (
        "a pod with no command (image entrypoint) is left to kwok",
        with_changes(kwok_pod(), spec__containers=[{"name": "x", "image": "nginx"}]),
        True,
        Action.IGNORE,
    ),
    (
        "only the first container decides",
        with_changes(
            kwok_pod(), spec__containers=[{"name": "s", "command": ["sh"]}, {"name": "e", "command": ["drs"]}]
        ),
        True,
        Action.IGNORE,
    ),
    ("a pod-network drs pod is refused", with_changes(kwok_pod(), spec__hostNetwork=False), True, Action.REFUSE),
    (
        "a drs pod without hostNetwork set is refused",
        with_changes(kwok_pod(), spec__hostNetwork=None),
        True,
        Action.REFUSE,
    ),
    ("a pod kwok has not started waits", with_changes(kwok_pod(), status={"phase": "Pending"}), True, Action.WAIT),
    ("a running pod without a host IP waits", with_changes(kwok_pod(), status__hostIP=None), True, Action.WAIT),
    (
        "a pod being deleted stops",
        with_changes(kwok_pod(), metadata__deletionTimestamp="2026-01-01T00:00:05Z"),
        True,
        Action.STOP,
    ),
    ("a succeeded pod stops", with_changes(kwok_pod(), status__phase="Succeeded"), True, Action.STOP),
    ("a failed pod stops", with_changes(kwok_pod(), status__phase="Failed"), True, Action.STOP),
]


@pytest.mark.parametrize(
    ("pod", "on_dev_node", "action"), [c[1:] for c in CLASSIFY_CASES], ids=[c[0] for c in CLASSIFY_CASES]
)
def test_classify(pod: dict[str, Any], on_dev_node: bool, action: Action) -> None:
    assert classify(pod, on_dev_node).action is action


def test_a_refusal_says_only_host_network_pods_can_run() -> None:
    assert classify(with_changes(kwok_pod(), spec__hostNetwork=False), True).why == NOT_HOST_NETWORK_MESSAGE


def test_back_off_doubles_from_one_second_and_stops_at_thirty() -> None:
    assert [restart_delay_s(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert restart_delay_s(10_000) == BACKOFF_MAX_S


def test_a_process_that_ran_a_minute_starts_the_back_off_again() -> None:
    assert next_consecutive_exits(5, ran_for_s=2.0) == 6
    assert next_consecutive_exits(5, ran_for_s=61.0) == 1


@pytest.mark.parametrize(
    ("changes", "grace"),
    [
        ({}, STOP_GRACE_CAP_S),
        ({"spec__terminationGracePeriodSeconds": 3}, 3.0),
        ({"spec__terminationGracePeriodSeconds": 0}, 0.0),
        ({"spec__terminationGracePeriodSeconds": 600}, STOP_GRACE_CAP_S),
        ({"spec__terminationGracePeriodSeconds": 30, "metadata__deletionGracePeriodSeconds": 1}, 1.0),
    ],
    ids=[
        "default 30s is capped",
        "the pod's grace",
        "zero grace",
        "a long grace is capped",
        "the deletion's grace wins",
    ],
)
def test_stop_grace(changes: dict[str, Any], grace: float) -> None:
    assert stop_grace_s(with_changes(kwok_pod(), **changes)) == grace


def test_each_pod_incarnation_has_its_own_work_directory() -> None:
    assert workdir_name(kwok_pod()) == "ns_e-0_01234567"


# ---------------------------------------------------------------------------- probes


def test_an_http_probe_takes_its_port_path_and_timing_from_the_spec() -> None:
    container = {
        "name": "e",
        "ports": [{"name": "http", "containerPort": 18001}],
        "readinessProbe": {
            "httpGet": {"path": "health", "port": "http", "httpHeaders": [{"name": "X-A", "value": "1"}]},
            "periodSeconds": 2,
            "failureThreshold": 1,
        },
    }
    probe = readiness_probe(container)
    assert probe is not None
    assert probe.url("127.0.1.2") == "http://127.0.1.2:18001/health"
    assert (probe.period_s, probe.timeout_s, probe.failure_threshold, probe.headers) == (2.0, 1.0, 1, (("X-A", "1"),))


def test_probe_defaults_are_the_kubernetes_defaults_with_a_one_second_floor() -> None:
    probe = readiness_probe({"readinessProbe": {"httpGet": {"port": 80}}})
    assert probe == Probe(kind="http", port=80, period_s=10.0, timeout_s=1.0, success_threshold=1, failure_threshold=3)
    assert readiness_probe({"readinessProbe": {"tcpSocket": {"port": "81"}}}) == Probe(kind="tcp", port=81)


def test_a_probe_host_overrides_the_pod_ip_and_https_is_kept() -> None:
    probe = readiness_probe({"readinessProbe": {"httpGet": {"port": 443, "host": "127.0.9.9", "scheme": "HTTPS"}}})
    assert probe is not None and probe.url("127.0.1.2") == "https://127.0.9.9:443/"


def test_no_readiness_probe_means_none() -> None:
    assert readiness_probe({"name": "e"}) is None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"exec": {"command": ["true"]}}, "exec is not supported"),
        ({"httpGet": {"port": "metrics"}}, "'metrics' names no port"),
    ],
    ids=["an exec probe", "a named port the container does not declare"],
)
def test_a_probe_the_runner_cannot_run_is_a_named_error(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(ProbeSpecError, match=message):
        readiness_probe({"readinessProbe": spec})


@pytest.mark.parametrize(
    ("code", "ok"), [(200, True), (204, True), (302, True), (399, True), (404, False), (500, False), (503, False)]
)
def test_http_probe_success_is_200_to_399(code: int, ok: bool) -> None:
    assert probe_succeeded(code) is ok


def test_readiness_follows_the_thresholds() -> None:
    probe = Probe(kind="http", port=1, success_threshold=2, failure_threshold=3)
    seen = []
    state = Readiness()
    for ok in [True, True, False, False, True, False, False, False, True, True]:
        state = state.observe(ok, probe)
        seen.append(state.ready)
    assert seen == [False, True, True, True, True, True, True, False, False, True]


# ---------------------------------------------------------------------------- status and events


def running(ready: bool, restarts: int = 0) -> ContainerRun:
    return ContainerRun(ready=ready, restart_count=restarts, container_id="drs-runner://42", started_at=NOW)


def test_a_not_ready_process_turns_kwoks_ready_pod_not_ready() -> None:
    patch = status_patch(kwok_pod(), running(ready=False), NOW)
    assert patch is not None
    conditions = {c["type"]: c for c in patch["status"]["conditions"]}
    assert set(conditions) == {"Ready", "ContainersReady"}
    assert conditions["Ready"]["status"] == "False" and conditions["Ready"]["lastTransitionTime"] == NOW
    assert conditions["Ready"]["reason"] == "ContainersNotReady"
    first = patch["status"]["containerStatuses"][0]
    assert first["ready"] is False and first["state"] == {"running": {"startedAt": NOW}}
    assert patch["metadata"]["uid"] == "0123456789abcdef"


def test_status_is_written_only_when_it_changed() -> None:
    pod = kwok_pod()
    patch = status_patch(pod, running(ready=True), NOW)
    assert patch is not None and "conditions" not in patch["status"]  # already Ready: conditions untouched
    pod["status"]["containerStatuses"] = patch["status"]["containerStatuses"]
    assert status_patch(pod, running(ready=True), NOW) is None


def test_a_crashed_process_is_waiting_with_its_last_exit_and_restart_count() -> None:
    run = ContainerRun(
        ready=False,
        restart_count=2,
        container_id="drs-runner://42",
        waiting_reason="CrashLoopBackOff",
        waiting_message="runner: process exited with code 3; restarting in 2s",
        last_exit=LastExit(3, "2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z"),
    )
    patch = status_patch(kwok_pod(), run, NOW)
    assert patch is not None
    first = patch["status"]["containerStatuses"][0]
    assert first["restartCount"] == 2 and first["started"] is False
    assert first["state"]["waiting"]["reason"] == "CrashLoopBackOff"
    assert first["lastState"]["terminated"] == {
        "exitCode": 3,
        "reason": "Error",
        "startedAt": "2026-01-01T00:00:01Z",
        "finishedAt": "2026-01-01T00:00:02Z",
    }


def test_other_container_statuses_are_kept_because_the_list_is_replaced_whole() -> None:
    pod = kwok_pod()
    pod["status"]["containerStatuses"].append({"name": "sidecar", "ready": True, "restartCount": 0})
    patch = status_patch(pod, running(ready=False), NOW)
    assert patch is not None
    assert [s["name"] for s in patch["status"]["containerStatuses"]] == ["engine", "sidecar"]


def test_an_unchanged_condition_keeps_its_transition_time() -> None:
    pod = kwok_pod()
    pod["status"]["conditions"][1] = {"type": "Ready", "status": "False", "lastTransitionTime": "T0"}
    patch = status_patch(pod, running(ready=False), NOW)
    assert patch is not None
    assert [c["type"] for c in patch["status"]["conditions"]] == ["ContainersReady"]


def test_an_event_names_the_pod_its_container_and_the_runner() -> None:
    body = event_body(kwok_pod(), "BackOff", "runner: process exited with code 3; restarting in 1s", True, NOW)
    assert body["involvedObject"]["uid"] == "0123456789abcdef"
    assert body["involvedObject"]["fieldPath"] == "spec.containers{engine}"
    assert body["type"] == "Warning" and body["source"] == {"component": "drs-pod-runner", "host": "hgx-001"}
    assert body["metadata"] == {"generateName": "e-0.", "namespace": "ns"}
