"""A real kubelet refreshes a pod's mounted ConfigMap at once when the pod object is updated
(issue 22: the desired weights reach a running engine in seconds, not at the kubelet's periodic
sync). Two pods mount one ConfigMap and print its file whenever it changes; the ConfigMap is
replaced, then only the first pod gets an annotation patch (what the operator does when the desired
weights change: ``drs_operator.weights_touch``). The patched pod sees the new file within
``PATCHED_S``; the other one (the control) only at the kubelet's periodic sync, measured and
reported. What would break it: a kubelet that does not sync a pod on its update (then the patched
pod waits as long as the control)."""

from __future__ import annotations

import json
import time

import pytest
from drs_devcluster import nodeconfig
from drs_devcluster.testing import RunningCluster
from drs_operator.api.constants import ANNOTATION_DESIRED_WEIGHTS_TOUCH
from drs_protocol.env import DESIRED_WEIGHTS_KEY

from .pods import apply, image_pod, logs, wait_phase

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]

CONFIG = "weights"
MOUNT = "/etc/drs/weights"
#: the file seen changed this soon after the patch (the kubelet's pod sync plus its 0.1 s poll)
PATCHED_S = 10.0
#: how long the control pod is given (the kubelet's default sync period is a minute, plus its cache's)
CONTROL_S = 150.0
#: each pod prints ``<epoch seconds> <content>`` whenever its mounted file changes
WATCH = (
    f"prev=x; while :; do v=$(cat {MOUNT}/{DESIRED_WEIGHTS_KEY} 2>/dev/null); "
    'if [ "$v" != "$prev" ]; then echo "$(date +%s.%N) $v"; prev=$v; fi; sleep 0.1; done'
)


def _configmap(ns: str, value: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": CONFIG, "namespace": ns},
        "data": {DESIRED_WEIGHTS_KEY: value},
    }


def _watcher(ns: str, name: str) -> dict[str, object]:
    return image_pod(
        name,
        ns,
        WATCH,
        volumes=[{"name": "w", "configMap": {"name": CONFIG, "optional": True}}],
        container={"volumeMounts": [{"name": "w", "mountPath": MOUNT, "readOnly": True}]},
    )


def _seen(cluster: RunningCluster, ns: str, name: str, value: str) -> float | None:
    """When the pod's file first read ``value`` (epoch seconds), or None."""
    for line in logs(cluster, ns, name).splitlines():
        stamp, _, content = line.partition(" ")
        if content.strip() == value:
            return float(stamp)
    return None


def test_an_annotation_patch_makes_the_kubelet_refresh_the_mounted_configmap_at_once(
    realcluster: RunningCluster, realns: str
) -> None:
    node = json.loads(realcluster.kubectl("get", "node", nodeconfig.node_name(0), "-o", "json").stdout)
    version = node["status"]["nodeInfo"]["kubeletVersion"]
    apply(realcluster, _configmap(realns, "old"), _watcher(realns, "patched"), _watcher(realns, "control"))
    for name in ("patched", "control"):
        wait_phase(realcluster, realns, name, {"Running"})
    deadline = time.monotonic() + 60
    while not all(_seen(realcluster, realns, n, "old") for n in ("patched", "control")):
        assert time.monotonic() < deadline, "the pods never read the first value"
        time.sleep(0.5)
    changed = time.time()
    apply(realcluster, _configmap(realns, "new"))
    touch = json.dumps({"metadata": {"annotations": {ANNOTATION_DESIRED_WEIGHTS_TOUCH: "1"}}})
    realcluster.kubectl("patch", "pod", "patched", "-n", realns, "--type=merge", "-p", touch)
    patched_at = control_at = None
    deadline = time.monotonic() + CONTROL_S
    while (patched_at is None or control_at is None) and time.monotonic() < deadline:
        patched_at = patched_at or _seen(realcluster, realns, "patched", "new")
        control_at = control_at or _seen(realcluster, realns, "control", "new")
        time.sleep(0.5)
    patched_s = None if patched_at is None else patched_at - changed
    control_s = None if control_at is None else control_at - changed
    print(f"kubelet {version}: file changed {patched_s} s after the ConfigMap with the patch, {control_s} s without")
    assert patched_s is not None and patched_s < PATCHED_S, (patched_s, control_s)
    # the pod was not restarted by the patch: the same container, no restart
    status = json.loads(realcluster.kubectl("get", "pod", "patched", "-n", realns, "-o", "json").stdout)["status"]
    assert status["containerStatuses"][0]["restartCount"] == 0
