"""Helpers of the real-node tests: pods of the project's image, waiting on their phase, logs."""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import yaml
from drs_devcluster import images, nodeconfig
from drs_devcluster.testing import RunningCluster

#: Where the module fixtures install the operator chart (release ``drs``).
OPERATOR_NS = "drs-system"
WAIT_S = 120.0
POLL_S = 0.5


def image_pod(name: str, namespace: str, script: str, **spec: Any) -> dict[str, Any]:
    """A pod of drs:<version> on the real node running ``sh -c script`` once."""
    container: dict[str, Any] = {
        "name": "main",
        "image": images.image_ref(),
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script],
    }
    container.update(spec.pop("container", {}))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {nodeconfig.REAL_NODE_LABEL: "true"},
            "containers": [container],
            **spec,
        },
    }


def apply(cluster: RunningCluster, *objs: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objs))


def pod(cluster: RunningCluster, namespace: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "pod", name, "-n", namespace, "-o", "json")
    body: dict[str, Any] = json.loads(out.stdout)
    return body


def wait_phase(
    cluster: RunningCluster, namespace: str, name: str, phases: set[str], timeout: float = WAIT_S
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        body = pod(cluster, namespace, name)
        if body.get("status", {}).get("phase") in phases:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name} not in {phases} after {timeout:.0f}s: {json.dumps(body.get('status'))}")
        time.sleep(POLL_S)


def wait_waiting_reason(cluster: RunningCluster, namespace: str, name: str, timeout: float = WAIT_S) -> str:
    """The reason the pod's container waits with (e.g. CreateContainerConfigError)."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = pod(cluster, namespace, name).get("status", {}).get("containerStatuses") or []
        waiting = (statuses[0].get("state", {}).get("waiting") or {}) if statuses else {}
        if waiting.get("reason") and waiting["reason"] != "ContainerCreating":
            return str(waiting["reason"]) + ": " + str(waiting.get("message", ""))
        if time.monotonic() > deadline:
            raise AssertionError(f"pod {name}: no waiting reason after {timeout:.0f}s: {statuses}")
        time.sleep(POLL_S)


#: How long a log read may keep failing on the API server's way to the kubelet.
LOGS_S = 60.0


def logs(cluster: RunningCluster, namespace: str, name: str, *args: str, timeout: float = LOGS_S) -> str:
    """The pod's log (``args``: e.g. ``-c`` and a container). ``kubectl logs`` goes through the API
    server to the node's kubelet, a connection of its own that timed out once on a loaded 2-core CI
    machine (``dial tcp <node>:<kubelet port>: i/o timeout``) while the pod had ended; such a
    server error is asked again until ``timeout``, any other failure raises at once."""
    deadline = time.monotonic() + timeout
    while True:
        proc = cluster.kubectl("logs", name, "-n", namespace, *args, check=False)
        if proc.returncode == 0:
            return proc.stdout
        if "Error from server" not in proc.stderr or time.monotonic() > deadline:
            raise AssertionError(
                f"kubectl logs {name} -n {namespace} failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        time.sleep(POLL_S)


#: What ``explain`` asks kubectl, each as (title, argv): enough to tell why a fleet did not come up
#: (an operator not running, a pod unscheduled or crash-looping, a node NotReady or out of GPUs).
EXPLAIN = (
    ("nodes", ("get", "nodes", "-o", "wide")),
    (
        "node conditions",
        ("get", "nodes", "-o", "custom-columns=NAME:.metadata.name,TRUE:.status.conditions[?(@.status=='True')].type"),
    ),
    ("operator pods", ("get", "pods", "-n", OPERATOR_NS, "-o", "wide")),
    ("operator log", ("logs", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=drs-operator", "--tail=40")),
    (
        "operator log before its last restart",
        ("logs", "-n", OPERATOR_NS, "-l", "app.kubernetes.io/name=drs-operator", "--previous", "--tail=20"),
    ),
    ("pods in every namespace", ("get", "pods", "-A", "-o", "wide")),
)
EXPLAIN_LINES = 60  #: each answer's last lines
EXPLAIN_KUBECTL_S = 20.0  #: each ask's limit


def explain(cluster: RunningCluster, namespace: str) -> str:
    """A failure's context for the report: the nodes, the operator, every pod, the namespace's
    DisaggReplicaSets' status and events (each answer cut to its last ``EXPLAIN_LINES``)."""
    asks = (
        *EXPLAIN,
        ("DisaggReplicaSets' status", ("get", "drs", "-n", namespace, "-o", "jsonpath={.items[*].status}")),
        ("events", ("get", "events", "-n", namespace, "--sort-by=.lastTimestamp")),
    )
    parts = []
    for title, argv in asks:
        try:
            proc = cluster.kubectl(*argv, check=False, timeout=EXPLAIN_KUBECTL_S)
            text = (proc.stdout + proc.stderr).strip().splitlines()[-EXPLAIN_LINES:]
        except subprocess.TimeoutExpired:  # an API server that does not answer is an answer too
            text = [f"no answer within {EXPLAIN_KUBECTL_S:.0f}s"]
        parts.append(f"--- {title} (kubectl {' '.join(argv)}):\n" + "\n".join(text))
    return "\n".join(parts)
