"""The local pod runner against the real control plane: pods on simulated nodes become processes.

Every pod here runs ``drs dev echo-server`` (a test double) on node hgx-001 with host networking,
bound to ``$(DRS_NODE_IP)``; requests go to the pod's ``status.hostIP`` like a client that read the
address from the API would.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from drs_devcluster import processes
from drs_devcluster.cluster import DevClusterError
from drs_devcluster.profiles import node_net
from drs_devcluster.runner_daemon import PIDS_FILE, RUNNER_NAME, start_runner, stop_runner
from drs_devcluster.testing import RunningCluster

pytestmark = pytest.mark.cluster

DRS = str(Path(sys.executable).parent / "drs")
NODE = "hgx-001"
HTTP_TIMEOUT_S = 2.0
#: From pod creation to an answering process: kwok marks it Running, the runner starts Python.
START_TIMEOUT_S = 40.0
STOP_TIMEOUT_S = 20.0
READY_TIMEOUT_S = 30.0
#: How long a NotReady verdict must hold to show kwok does not overwrite it.
HOLD_S = 8.0
POLL_S = 0.25

T = TypeVar("T")


@pytest.fixture(scope="module")
def runner(devcluster: RunningCluster) -> Iterator[processes.Tracked]:
    tracked = start_runner(devcluster.cluster)
    try:
        yield tracked
    finally:
        stop_runner(devcluster.cluster)
        # Shown by pytest when a test of this module failed: what the runner saw and did.
        print(f"--- {tracked.log}:\n{processes.log_tail(tracked.log, lines=200)}")


@pytest.fixture
def core(devcluster: RunningCluster) -> Any:
    from kubernetes import client

    return client.CoreV1Api(devcluster.api_client())


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=HTTP_TIMEOUT_S) as c:
        yield c


def echo_pod(name: str, port: int, *extra_args: str, host_network: bool = True, **container: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "echo"}},
        "spec": {
            "nodeName": NODE,
            "hostNetwork": host_network,
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "echo",
                    "image": "drs/dev:test",
                    "command": ["drs", "dev", "echo-server"],
                    "args": ["--host", "$(DRS_NODE_IP)", "--port", str(port), *extra_args],
                    **container,
                }
            ],
        },
    }


def health_probe(port: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 1, "failureThreshold": 1}


def eventually(check: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll ``check`` until it returns something other than None/False; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            result = check()
            last = result
            if result is not None and result is not False:
                return result
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true after {timeout_s:.0f}s (last: {last!r})")
        time.sleep(POLL_S)


def host_ip(core: Any, namespace: str, name: str) -> str:
    def read() -> str | None:
        ip: str | None = core.read_namespaced_pod(name, namespace).status.host_ip
        return ip

    return eventually(read, START_TIMEOUT_S, f"{name} has a hostIP")


def answers(http: httpx.Client, url: str) -> Callable[[], dict[str, Any] | None]:
    def get() -> dict[str, Any] | None:
        resp = http.get(url)
        return dict(resp.json()) if resp.status_code == 200 else None

    return get


def refuses(http: httpx.Client, url: str) -> Callable[[], bool]:
    def get() -> bool:
        try:
            http.get(url)
        except httpx.ConnectError:
            return True
        return False

    return get


def ready_state(core: Any, namespace: str, name: str) -> tuple[str, str, bool]:
    """(Ready condition, ContainersReady condition, containerStatuses[0].ready)."""
    return _ready_of(core.read_namespaced_pod(name, namespace).status)


def _ready_of(status: Any) -> tuple[str, str, bool]:
    conditions = {c.type: c.status for c in status.conditions or []}
    first = (status.container_statuses or [None])[0]
    return conditions.get("Ready", ""), conditions.get("ContainersReady", ""), bool(first and first.ready)


def watched_ready_states(core: Any, namespace: str, name: str, seconds: float) -> list[tuple[str, str, bool]]:
    """The readiness of pod ``name`` now and after every write to it over the next ``seconds`` (a server-side
    watch from the current resourceVersion, ended by the apiserver after ``seconds``)."""
    from kubernetes import watch

    pod = core.read_namespaced_pod(name, namespace)
    stream = watch.Watch().stream(
        core.list_namespaced_pod,
        namespace,
        field_selector=f"metadata.name={name}",
        resource_version=pod.metadata.resource_version,
        timeout_seconds=int(seconds),
    )
    return [_ready_of(pod.status)] + [_ready_of(e["object"].status) for e in stream if e["type"] == "MODIFIED"]


def events(core: Any, namespace: str, name: str) -> list[Any]:
    return list(core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items)


def test_a_host_network_drs_pod_answers_on_its_node_address_and_stops_when_deleted(
    runner: processes.Tracked, core: Any, http: httpx.Client, namespace: str
) -> None:
    core.create_namespaced_pod(namespace, echo_pod("echo", 18711))
    ip = host_ip(core, namespace, "echo")
    info = eventually(answers(http, f"http://{ip}:18711/info"), START_TIMEOUT_S, "the pod's process answers")
    assert info["host"] == ip and info["port"] == 18711
    assert http.get(f"http://{ip}:18711/health").status_code == 200
    assert ip.startswith(f"127.{node_net()}.") and ip != "127.0.0.1"

    core.delete_namespaced_pod("echo", namespace)
    eventually(refuses(http, f"http://{ip}:18711/health"), STOP_TIMEOUT_S, "the port stops answering")


def test_the_process_gets_the_environment_and_command_line_a_kubelet_would_give_it(
    runner: processes.Tracked, core: Any, http: httpx.Client, namespace: str, devcluster: RunningCluster
) -> None:
    core.create_namespaced_secret(namespace, {"metadata": {"name": "creds"}, "stringData": {"token": "s3cr3t"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "cfg"}, "data": {"MODE": "fast"}})
    env = [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        {"name": "ABSENT", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k", "optional": True}}},
        {"name": "URL", "value": "http://$(POD_IP):18712/$(POD_NAME) $$(POD_NAME)"},
    ]
    pod = echo_pod("envy", 18712, "--health-status", "$(HEALTH)", env=env, envFrom=[{"configMapRef": {"name": "cfg"}}])
    pod["spec"]["containers"][0]["env"].append({"name": "HEALTH", "value": "204"})
    core.create_namespaced_pod(namespace, pod)
    ip = host_ip(core, namespace, "envy")
    base = f"http://{ip}:18712"
    info = eventually(answers(http, f"{base}/info"), START_TIMEOUT_S, "the pod's process answers")

    def value(name: str) -> str | None:
        resp = http.get(f"{base}/env/{name}")
        return str(resp.json()["value"]) if resp.status_code == 200 else None

    assert value("TOKEN") == "s3cr3t"
    assert value("POD_NAME") == "envy" and value("POD_IP") == ip and value("APP") == "echo"
    assert value("MODE") == "fast" and value("DRS_NODE_IP") == ip
    assert value("URL") == f"http://{ip}:18712/envy $(POD_NAME)"
    assert value("ABSENT") is None
    assert http.get(f"{base}/health").status_code == 204  # $(HEALTH) in args, expanded
    assert info["argv"][1:] == ["dev", "echo-server", "--host", ip, "--port", "18712", "--health-status", "204"]
    uid = core.read_namespaced_pod("envy", namespace).metadata.uid
    workdir = Path(info["cwd"])
    assert workdir == devcluster.cluster.layout.state_dir / "pods" / f"{namespace}_envy_{uid[:8]}"
    assert "echo-server: listening on" in (workdir / "log").read_text()


def test_a_missing_secret_is_reported_and_the_pod_starts_once_it_exists(
    runner: processes.Tracked, core: Any, http: httpx.Client, namespace: str
) -> None:
    env = [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "later", "key": "token"}}}]
    core.create_namespaced_pod(namespace, echo_pod("waits", 18713, env=env))
    ip = host_ip(core, namespace, "waits")

    def config_error() -> str | None:
        messages = [e.message for e in events(core, namespace, "waits") if e.reason == "CreateContainerConfigError"]
        return messages[0] if messages else None

    message = eventually(config_error, START_TIMEOUT_S, "a CreateContainerConfigError event")
    assert "secret 'later' not found" in message
    assert refuses(http, f"http://{ip}:18713/health")()

    core.create_namespaced_secret(namespace, {"metadata": {"name": "later"}, "stringData": {"token": "t"}})
    eventually(answers(http, f"http://{ip}:18713/info"), START_TIMEOUT_S, "the process starts once the secret exists")


def test_a_process_that_exits_is_restarted_with_back_off_and_counted(
    runner: processes.Tracked, core: Any, http: httpx.Client, namespace: str
) -> None:
    core.create_namespaced_pod(namespace, echo_pod("crashy", 18714, "--exit-after", "1", "--exit-code", "3"))
    ip = host_ip(core, namespace, "crashy")

    def restarted_twice() -> Any:
        status = core.read_namespaced_pod("crashy", namespace).status
        first = (status.container_statuses or [None])[0]
        return first if first is not None and (first.restart_count or 0) >= 2 else None

    first = eventually(restarted_twice, START_TIMEOUT_S, "restartCount reaches 2")
    assert first.last_state.terminated.exit_code == 3
    back_offs = sorted(e.message for e in events(core, namespace, "crashy") if e.reason == "BackOff")
    assert "runner: process exited with code 3; restarting in 1s" in back_offs
    assert "runner: process exited with code 3; restarting in 2s" in back_offs
    eventually(answers(http, f"http://{ip}:18714/info"), START_TIMEOUT_S, "the restarted process answers again")


def test_readiness_follows_the_real_probe_and_kwok_does_not_overwrite_it(
    runner: processes.Tracked, core: Any, http: httpx.Client, namespace: str
) -> None:
    pod = echo_pod("sick", 18715, "--health-status", "503", readinessProbe=health_probe(18715))
    core.create_namespaced_pod(namespace, pod)
    ip = host_ip(core, namespace, "sick")
    base = f"http://{ip}:18715"
    eventually(answers(http, f"{base}/info"), START_TIMEOUT_S, "the pod's process answers")
    assert http.get(f"{base}/health").status_code == 503

    # kwok marked the pod Ready at once; the runner turns that into the probe's truth and it holds.
    eventually(lambda: ready_state(core, namespace, "sick") == ("False", "False", False), READY_TIMEOUT_S, "NotReady")
    # An absence (nothing writes Ready back) has no event to wait on, and kwok acknowledges nothing
    # it decides not to do; so watch every write to the pod for HOLD_S (a poll could miss a flip
    # and its flip back) and require each one to keep the verdict.
    writes = watched_ready_states(core, namespace, "sick", HOLD_S)
    assert all(state == ("False", "False", False) for state in writes), writes
    assert core.read_namespaced_pod("sick", namespace).status.phase == "Running"

    http.post(f"{base}/health", params={"status": "200"})
    eventually(lambda: ready_state(core, namespace, "sick") == ("True", "True", True), READY_TIMEOUT_S, "Ready")
    http.post(f"{base}/health", params={"status": "500"})
    eventually(lambda: ready_state(core, namespace, "sick") == ("False", "False", False), READY_TIMEOUT_S, "NotReady")
    assert any(e.reason == "Unhealthy" for e in events(core, namespace, "sick"))


def test_a_pod_without_host_network_is_refused_with_a_warning_event(
    runner: processes.Tracked, core: Any, namespace: str
) -> None:
    core.create_namespaced_pod(namespace, echo_pod("podnet", 18716, host_network=False))

    def warning() -> Any:
        return next((e for e in events(core, namespace, "podnet") if e.reason == "NotHostNetwork"), None)

    event = eventually(warning, START_TIMEOUT_S, "a NotHostNetwork event")
    assert event.type == "Warning" and event.message == "runner: only hostNetwork pods can run locally"


def test_a_pod_replaced_under_the_same_name_gets_a_new_process_on_the_same_port(
    runner: processes.Tracked, core: Any, http: httpx.Client, namespace: str
) -> None:
    core.create_namespaced_pod(namespace, echo_pod("again", 18717))
    ip = host_ip(core, namespace, "again")
    url = f"http://{ip}:18717/info"
    before = eventually(answers(http, url), START_TIMEOUT_S, "the first process answers")

    core.delete_namespaced_pod("again", namespace)
    eventually(lambda: not core.list_namespaced_pod(namespace).items, STOP_TIMEOUT_S, "the old pod is gone")
    core.create_namespaced_pod(namespace, echo_pod("again", 18717))

    def new_process() -> dict[str, Any] | None:
        info = answers(http, url)()
        return info if info is not None and info["pid"] != before["pid"] else None

    after = eventually(new_process, START_TIMEOUT_S, "a new process answers on the same port")
    assert after["cwd"] != before["cwd"]  # one work directory per pod UID
    log = (Path(after["cwd"]) / "log").read_text()
    assert "cannot bind" not in log


def test_pods_that_are_not_ours_are_left_to_kwok(
    runner: processes.Tracked, core: Any, http: httpx.Client, namespace: str, devcluster: RunningCluster
) -> None:
    pod = echo_pod("other", 18718)
    pod["spec"]["containers"][0]["command"] = ["sleep", "infinity"]
    core.create_namespaced_pod(namespace, pod)
    eventually(lambda: ready_state(core, namespace, "other") == ("True", "True", True), READY_TIMEOUT_S, "kwok's Ready")
    # The runner handles pod events in order: once it runs a pod created after "other", it has
    # already decided about "other".
    core.create_namespaced_pod(namespace, echo_pod("later", 18720))
    ip = host_ip(core, namespace, "later")
    eventually(answers(http, f"http://{ip}:18720/info"), START_TIMEOUT_S, "the later pod's process answers")
    assert ready_state(core, namespace, "other") == ("True", "True", True)
    pods_dir = devcluster.cluster.layout.state_dir / "pods"
    assert not list(pods_dir.glob(f"{namespace}_other_*"))


def test_what_drs_dev_down_stops_includes_the_runner_and_its_processes_and_a_new_runner_takes_over(
    runner: processes.Tracked, core: Any, http: httpx.Client, namespace: str, devcluster: RunningCluster
) -> None:
    pids_file = devcluster.cluster.layout.state_dir / PIDS_FILE
    core.create_namespaced_pod(namespace, echo_pod("tracked", 18719))
    ip = host_ip(core, namespace, "tracked")
    url = f"http://{ip}:18719/info"
    before = eventually(answers(http, url), START_TIMEOUT_S, "the pod's process answers")
    recorded = {t.name: t for t in processes.load(pids_file)}
    assert recorded[RUNNER_NAME].pid == runner.pid
    assert recorded[f"pod {namespace}/tracked"].pid == before["pid"]
    with pytest.raises(DevClusterError, match="a pod runner already runs"):
        start_runner(devcluster.cluster)

    # What `drs dev down` does with runner-pids.json: stop every recorded pid.
    stopped = processes.stop(processes.load(pids_file))
    assert RUNNER_NAME in stopped and f"pod {namespace}/tracked" in stopped
    assert refuses(http, url)()

    # A runner in the foreground runs the pod again and stops it on Ctrl-C.
    state = str(devcluster.cluster.layout.state_dir)
    foreground = subprocess.Popen(
        [DRS, "dev", "run-pods", "--state-dir", state, "--foreground"], stderr=subprocess.PIPE
    )
    try:
        again = eventually(answers(http, url), START_TIMEOUT_S, "the foreground runner starts the pod again")
        assert again["pid"] != before["pid"]
    finally:
        foreground.send_signal(signal.SIGINT)
        _, stderr = foreground.communicate(timeout=STOP_TIMEOUT_S)
    assert foreground.returncode == 0, stderr.decode()
    assert refuses(http, url)()
    assert not pids_file.exists()

    # `drs dev run-pods` starts one in the background again (the module's other tests use it).
    cli = subprocess.run(
        [DRS, "dev", "run-pods", "--state-dir", state], capture_output=True, text=True, timeout=START_TIMEOUT_S
    )
    assert cli.returncode == 0 and "pod runner watching" in cli.stdout, cli.stderr
    eventually(answers(http, url), START_TIMEOUT_S, "the background runner starts the pod again")
