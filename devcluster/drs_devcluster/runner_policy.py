"""The local pod runner's decisions, as pure functions: which pods to run, when to restart, what to
probe, and what to write to a pod's status and Events.

* ``classify``: a pod is the runner's when it is bound to a dev node (``disagg.dev/dev-node=true``)
  and its first container's ``command[0]`` is ``drs``. Of those, only ``hostNetwork`` pods can run
  (a pod IP from the cluster CIDR is not an address of this machine): the others are refused with a
  Warning Event. A pod runs once kwok has made it ``Running`` with a host IP (so kwok's pod-ready
  stage, which acts only on Pending pods, never overwrites the runner's readiness afterwards) and
  stops when it is being deleted or has finished.
* ``restart_delay_s``: CrashLoopBackOff, 1 s doubling to 30 s; a process that ran for a minute
  before exiting starts the sequence again.
* ``readiness_probe`` / ``Readiness``: the kubelet's readiness semantics (``httpGet`` and
  ``tcpSocket``; initial delay, period, timeout, success and failure thresholds); a container
  without a readiness probe is ready while its process runs.
* ``status_patch``: the strategic-merge patch of the status subresource that makes ``Ready``,
  ``ContainersReady`` and ``containerStatuses[0]`` tell the truth about the process, or None when
  the pod already says so (status is written only when it changed).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, Final

from .runner_env import is_drs_command

#: The ``source.component`` and ``reportingComponent`` of the runner's Events.
EVENT_COMPONENT: Final = "drs-pod-runner"
BACKOFF_INITIAL_S: Final = 1.0
BACKOFF_MAX_S: Final = 30.0
#: A process that ran at least this long before exiting restarts after BACKOFF_INITIAL_S again.
BACKOFF_RESET_AFTER_S: Final = 60.0
DEFAULT_TERMINATION_GRACE_S: Final = 30.0
#: Stops are capped so the runner's own shutdown fits inside ``processes.STOP_GRACE_S`` (10 s).
STOP_GRACE_CAP_S: Final = 8.0
#: Readiness probe defaults (as in the Kubernetes API) and the dev floor on the period.
PROBE_PERIOD_DEFAULT_S: Final = 10.0
PROBE_PERIOD_MIN_S: Final = 1.0
PROBE_TIMEOUT_DEFAULT_S: Final = 1.0
PROBE_FAILURE_THRESHOLD_DEFAULT: Final = 3
PROBE_SUCCESS_THRESHOLD_DEFAULT: Final = 1


class Reason(enum.StrEnum):
    """Event and condition reasons the runner writes."""

    NOT_HOST_NETWORK = "NotHostNetwork"
    STARTED = "Started"
    BACK_OFF = "BackOff"
    CONFIG_ERROR = "CreateContainerConfigError"
    UNHEALTHY = "Unhealthy"
    KILLING = "Killing"
    CONTAINERS_NOT_READY = "ContainersNotReady"
    CRASH_LOOP = "CrashLoopBackOff"
    ERROR = "Error"
    COMPLETED = "Completed"


NOT_HOST_NETWORK_MESSAGE: Final = "runner: only hostNetwork pods can run locally"


class Action(enum.Enum):
    IGNORE = "ignore"  # not the runner's pod
    REFUSE = "refuse"  # the runner's, but it cannot run (not hostNetwork)
    WAIT = "wait"  # the runner's, not started by kwok yet
    RUN = "run"  # the runner's, should have a process
    STOP = "stop"  # the runner's, being deleted or finished: no process


@dataclasses.dataclass(frozen=True)
class Decision:
    action: Action
    why: str


def classify(pod: Mapping[str, Any], on_dev_node: bool) -> Decision:
    """What the runner does with ``pod`` (``on_dev_node``: its spec.nodeName is a dev node)."""
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    containers = spec.get("containers") or []
    if not spec.get("nodeName"):
        return Decision(Action.IGNORE, "not bound to a node")
    if not on_dev_node:
        return Decision(Action.IGNORE, f"node {spec['nodeName']} is not a dev node")
    if not containers or not is_drs_command(containers[0]):
        return Decision(Action.IGNORE, "the first container's command is not drs")
    if not spec.get("hostNetwork"):
        return Decision(Action.REFUSE, NOT_HOST_NETWORK_MESSAGE)
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return Decision(Action.STOP, "being deleted")
    phase = status.get("phase")
    if phase in ("Succeeded", "Failed"):
        return Decision(Action.STOP, f"phase {phase}")
    if phase != "Running":
        return Decision(Action.WAIT, f"phase {phase or 'unset'}: kwok has not started it")
    if not status.get("hostIP"):
        return Decision(Action.WAIT, f"no hostIP: node {spec['nodeName']} has no InternalIP address")
    return Decision(Action.RUN, "running on a dev node")


def restart_delay_s(consecutive_exits: int) -> float:
    """CrashLoopBackOff: 1, 2, 4, … seconds, at most BACKOFF_MAX_S (``consecutive_exits`` >= 1)."""
    exponent = min(max(consecutive_exits, 1) - 1, 16)
    return float(min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2**exponent))


def next_consecutive_exits(previous: int, ran_for_s: float) -> int:
    """The exit count that picks the next delay: a long-lived process starts the sequence again."""
    return 1 if ran_for_s >= BACKOFF_RESET_AFTER_S else previous + 1


def stop_grace_s(pod: Mapping[str, Any]) -> float:
    """The deletion grace period (else terminationGracePeriodSeconds, default 30 s), capped."""
    meta_grace = (pod.get("metadata") or {}).get("deletionGracePeriodSeconds")
    spec_grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    grace = meta_grace if meta_grace is not None else spec_grace
    seconds = DEFAULT_TERMINATION_GRACE_S if grace is None else float(grace)
    return max(0.0, min(seconds, STOP_GRACE_CAP_S))


def workdir_name(pod: Mapping[str, Any]) -> str:
    """``<namespace>_<name>_<uid8>``: one directory per pod incarnation."""
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}_{meta.get('name', '')}_{str(meta.get('uid', ''))[:8]}"


# ---------------------------------------------------------------------------- readiness


@dataclasses.dataclass(frozen=True)
class Probe:
    """A readiness probe the runner can run: ``http`` (httpGet) or ``tcp`` (tcpSocket)."""

    kind: str
    port: int
    host: str | None = None
    path: str = "/"
    scheme: str = "http"
    headers: tuple[tuple[str, str], ...] = ()
    initial_delay_s: float = 0.0
    period_s: float = PROBE_PERIOD_DEFAULT_S
    timeout_s: float = PROBE_TIMEOUT_DEFAULT_S
    success_threshold: int = PROBE_SUCCESS_THRESHOLD_DEFAULT
    failure_threshold: int = PROBE_FAILURE_THRESHOLD_DEFAULT

    def url(self, pod_ip: str) -> str:
        path = self.path if self.path.startswith("/") else f"/{self.path}"
        return f"{self.scheme}://{self.host or pod_ip}:{self.port}{path}"


class ProbeSpecError(ValueError):
    """A readiness probe the runner cannot run; the message says why."""


def readiness_probe(container: Mapping[str, Any]) -> Probe | None:
    """The container's readiness probe, or None when it has none (exec and grpc probes: ProbeSpecError)."""
    spec = container.get("readinessProbe")
    if not spec:
        return None
    timing: dict[str, Any] = {
        "initial_delay_s": float(spec.get("initialDelaySeconds") or 0),
        "period_s": max(PROBE_PERIOD_MIN_S, float(spec.get("periodSeconds") or PROBE_PERIOD_DEFAULT_S)),
        "timeout_s": float(spec.get("timeoutSeconds") or PROBE_TIMEOUT_DEFAULT_S),
        "success_threshold": int(spec.get("successThreshold") or PROBE_SUCCESS_THRESHOLD_DEFAULT),
        "failure_threshold": int(spec.get("failureThreshold") or PROBE_FAILURE_THRESHOLD_DEFAULT),
    }
    if spec.get("httpGet"):
        get = spec["httpGet"]
        headers = tuple((str(h.get("name", "")), str(h.get("value", ""))) for h in get.get("httpHeaders") or [])
        return Probe(
            kind="http",
            port=_probe_port(container, get.get("port")),
            host=get.get("host") or None,
            path=str(get.get("path") or "/"),
            scheme=str(get.get("scheme") or "HTTP").lower(),
            headers=headers,
            **timing,
        )
    if spec.get("tcpSocket"):
        sock = spec["tcpSocket"]
        return Probe(kind="tcp", port=_probe_port(container, sock.get("port")), host=sock.get("host") or None, **timing)
    kinds = ", ".join(k for k in ("exec", "grpc") if spec.get(k)) or "unknown"
    raise ProbeSpecError(f"readinessProbe kind {kinds} is not supported by the local pod runner")


def _probe_port(container: Mapping[str, Any], port: Any) -> int:
    if isinstance(port, int):
        return port
    if isinstance(port, str) and port.isdigit():
        return int(port)
    for declared in container.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ProbeSpecError(f"readinessProbe port {port!r} names no port of the container")


def probe_succeeded(status_code: int) -> bool:
    """The kubelet's rule for httpGet probes: 200 <= code < 400."""
    return 200 <= status_code < 400


@dataclasses.dataclass(frozen=True)
class Readiness:
    """Readiness of one process run: not ready until ``success_threshold`` successes in a row,
    not ready again after ``failure_threshold`` failures in a row."""

    ready: bool = False
    successes: int = 0
    failures: int = 0

    def observe(self, ok: bool, probe: Probe) -> Readiness:
        if ok:
            successes = self.successes + 1
            return Readiness(ready=self.ready or successes >= probe.success_threshold, successes=successes)
        failures = self.failures + 1
        return Readiness(ready=self.ready and failures < probe.failure_threshold, failures=failures)


# ---------------------------------------------------------------------------- status and events


@dataclasses.dataclass(frozen=True)
class LastExit:
    exit_code: int
    started_at: str
    finished_at: str


@dataclasses.dataclass(frozen=True)
class ContainerRun:
    """What is true about the first container's process, for the pod's status."""

    ready: bool
    restart_count: int
    container_id: str
    started_at: str | None = None  # running since (None: waiting)
    waiting_reason: str | None = None
    waiting_message: str | None = None
    last_exit: LastExit | None = None


def status_patch(pod: Mapping[str, Any], run: ContainerRun, now: str) -> dict[str, Any] | None:
    """The status patch that makes ``pod`` tell ``run``'s truth, or None when it already does.

    Conditions merge by type (strategic merge); ``containerStatuses`` is an atomic list, so the
    whole list is sent with the first entry replaced. ``metadata.uid`` makes the patch fail
    rather than touch a replacement pod of the same name.
    """
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    name = str(containers[0].get("name", ""))
    current_statuses: list[dict[str, Any]] = [dict(s) for s in status.get("containerStatuses") or []]
    current_first = next((s for s in current_statuses if s.get("name") == name), {})
    first = _container_status(current_first, name, str(containers[0].get("image", "")), run)
    others = [s for s in current_statuses if s.get("name") != name]
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    wanted = "True" if run.ready else "False"
    changed_conditions = [
        _condition(kind, conditions.get(kind), wanted, name, now)
        for kind in ("Ready", "ContainersReady")
        if (conditions.get(kind) or {}).get("status") != wanted
    ]
    if not changed_conditions and first == current_first:
        return None
    patch_status: dict[str, Any] = {"containerStatuses": [first, *others]}
    if changed_conditions:
        patch_status["conditions"] = changed_conditions
    return {"metadata": {"uid": meta.get("uid")}, "status": patch_status}


def _condition(kind: str, current: Mapping[str, Any] | None, wanted: str, container: str, now: str) -> dict[str, Any]:
    ready = wanted == "True"
    return {
        "type": kind,
        "status": wanted,
        "lastProbeTime": None,
        "lastTransitionTime": now
        if (current or {}).get("status") != wanted
        else (current or {}).get("lastTransitionTime"),
        "reason": None if ready else Reason.CONTAINERS_NOT_READY.value,
        "message": None if ready else f"containers with unready status: [{container}]",
    }


def _container_status(current: Mapping[str, Any], name: str, image: str, run: ContainerRun) -> dict[str, Any]:
    state: dict[str, Any]
    if run.started_at is not None:
        state = {"running": {"startedAt": run.started_at}}
    else:
        state = {"waiting": {"reason": run.waiting_reason or Reason.CRASH_LOOP.value, "message": run.waiting_message}}
        state["waiting"] = {k: v for k, v in state["waiting"].items() if v is not None}
    last_state: dict[str, Any] = {}
    if run.last_exit is not None:
        last_state = {
            "terminated": {
                "exitCode": run.last_exit.exit_code,
                "reason": Reason.COMPLETED.value if run.last_exit.exit_code == 0 else Reason.ERROR.value,
                "startedAt": run.last_exit.started_at,
                "finishedAt": run.last_exit.finished_at,
            }
        }
    return {
        **current,
        "name": name,
        "image": current.get("image") or image,
        "imageID": current.get("imageID", ""),
        "containerID": run.container_id,
        "ready": run.ready,
        "started": run.started_at is not None,
        "restartCount": run.restart_count,
        "state": state,
        "lastState": last_state,
    }


def event_body(pod: Mapping[str, Any], reason: str, message: str, warning: bool, now: str) -> dict[str, Any]:
    """A core/v1 Event about the pod's first container."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    container = ((spec.get("containers") or [{}])[0]).get("name", "")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta.get('name', 'pod')}.", "namespace": meta.get("namespace")},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            "uid": meta.get("uid"),
            "fieldPath": f"spec.containers{{{container}}}",
        },
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": EVENT_COMPONENT, "host": spec.get("nodeName", "")},
        "reportingComponent": EVENT_COMPONENT,
        "reportingInstance": spec.get("nodeName", ""),
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
