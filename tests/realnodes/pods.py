"""Helpers of the real-node tests: pods of the project's image, waiting on their phase, logs."""

from __future__ import annotations

import json
import time
from typing import Any

import yaml
from drs_devcluster import images, nodeconfig
from drs_devcluster.testing import RunningCluster

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


def logs(cluster: RunningCluster, namespace: str, name: str) -> str:
    return cluster.kubectl("logs", name, "-n", namespace).stdout
