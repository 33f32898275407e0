"""A real node (kubelet + containerd + CNI bridge + kube-proxy + CoreDNS + the fake GPU device
plugin) running the project's image: capacity from a device-plugin registration, the restrictive
securityContext the operator renders enforced by a real kubelet, and Services reached by name
from pods, with in-cluster credentials."""

from __future__ import annotations

import json
import re

import pytest
from drs_devcluster import nodeconfig, profiles
from drs_devcluster.testing import RunningCluster
from drs_operator.manifests.common import restricted_container_security, restricted_pod_security, scratch

from .pods import apply, image_pod, logs, wait_phase, wait_waiting_reason

pytestmark = [pytest.mark.cluster, pytest.mark.realnode]


def test_the_real_node_is_ready_with_gpus_from_its_device_plugin(realcluster: RunningCluster) -> None:
    node = json.loads(realcluster.kubectl("get", "node", nodeconfig.node_name(0), "-o", "json").stdout)
    labels = node["metadata"]["labels"]
    assert labels[nodeconfig.REAL_NODE_LABEL] == "true"
    assert labels[profiles.GPU_COUNT_LABEL] == str(nodeconfig.GPUS_PER_REAL_NODE)
    assert profiles.GPU_PRODUCT_LABEL in labels
    # Capacity that only a registered device plugin gives a real kubelet (it zeroes the rest).
    assert node["status"]["allocatable"][profiles.GPU_RESOURCE] == str(nodeconfig.GPUS_PER_REAL_NODE)
    assert node["status"]["nodeInfo"]["kubeletVersion"].startswith("v1.")
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert ready["Ready"] == "True"


PROBE = (
    "id -u; id -g; "
    "if touch /probe 2>/dev/null; then echo ROOTFS-WRITABLE; else echo ROOTFS-READONLY; fi; "
    "touch /tmp/probe && echo SCRATCH-WRITABLE; "
    "grep -E '^(CapEff|CapBnd|NoNewPrivs|Seccomp):' /proc/self/status; "
    'echo "GPUS=$NVIDIA_VISIBLE_DEVICES"'
)


def test_the_restricted_security_context_holds_on_a_real_kubelet(realcluster: RunningCluster, realns: str) -> None:
    volume, mount = scratch()
    body = image_pod(
        "restricted",
        realns,
        PROBE,
        securityContext=restricted_pod_security(),
        volumes=[volume],
        container={
            "securityContext": restricted_container_security(),
            "volumeMounts": [mount],
            "resources": {"limits": {profiles.GPU_RESOURCE: "2"}},
        },
    )
    apply(realcluster, body)
    assert wait_phase(realcluster, realns, "restricted", {"Succeeded", "Failed"})["status"]["phase"] == "Succeeded"
    out = logs(realcluster, realns, "restricted")
    lines = out.split()
    assert lines[:2] == ["10001", "10001"], out
    assert "ROOTFS-READONLY" in out and "SCRATCH-WRITABLE" in out, out
    assert re.search(r"CapEff:\s+0+\n", out) and re.search(r"CapBnd:\s+0+\n", out), out
    assert re.search(r"NoNewPrivs:\s+1\n", out), out
    assert re.search(r"Seccomp:\s+2\n", out), out  # 2 = filter mode: the RuntimeDefault profile
    gpus = re.search(r"GPUS=(\S*)", out)
    assert gpus and len(gpus.group(1).split(",")) == 2, out  # set by the device plugin's Allocate


def test_without_the_security_context_the_same_probe_sees_root_and_a_writable_root(
    realcluster: RunningCluster, realns: str
) -> None:
    """The control: the image's defaults differ, so the assertions above can fail."""
    apply(realcluster, image_pod("loose", realns, PROBE, securityContext={"runAsUser": 0}))
    assert wait_phase(realcluster, realns, "loose", {"Succeeded", "Failed"})["status"]["phase"] == "Succeeded"
    out = logs(realcluster, realns, "loose")
    assert out.split()[0] == "0" and "ROOTFS-WRITABLE" in out, out
    assert not re.search(r"CapEff:\s+0+\n", out), out


def test_run_as_non_root_refuses_a_root_user(realcluster: RunningCluster, realns: str) -> None:
    body = image_pod("asks-root", realns, "id -u", securityContext={"runAsNonRoot": True, "runAsUser": 0})
    apply(realcluster, body)
    reason = wait_waiting_reason(realcluster, realns, "asks-root")
    assert reason.startswith("CreateContainerConfigError"), reason
    assert "non-root" in reason, reason


CLIENT = """
import os, socket, urllib.request
from kubernetes import client, config
ns = open("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read()
print("kubernetes", socket.gethostbyname("kubernetes.default.svc.cluster.local"))
print("web", socket.gethostbyname("web"))
print("body", urllib.request.urlopen("http://web:8080/hello.txt", timeout=10).read().decode().strip())
config.load_incluster_config()
me = client.CoreV1Api().read_namespaced_pod(os.environ["HOSTNAME"], ns)
print("in-cluster", me.metadata.name, me.status.pod_ip)
"""


def test_services_resolve_by_name_and_in_cluster_config_reaches_the_apiserver(
    realcluster: RunningCluster, realns: str
) -> None:
    server = image_pod(
        "web",
        realns,
        "mkdir -p /tmp/www && echo hello-from-web > /tmp/www/hello.txt && exec python -m http.server 8080 -d /tmp/www",
        container={"ports": [{"containerPort": 8080}]},
    )
    server["metadata"]["labels"] = {"app": "web"}
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web", "namespace": realns},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 8080, "targetPort": 8080}]},
    }
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "read-pods", "namespace": realns},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "read-pods", "namespace": realns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-pods"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": realns}],
    }
    apply(realcluster, server, service, role, binding)
    realcluster.kubectl("wait", "--for=condition=Ready", "pod/web", "-n", realns, "--timeout=120s")
    apply(realcluster, image_pod("client", realns, f"exec python -c '{CLIENT}'"))
    phase = wait_phase(realcluster, realns, "client", {"Succeeded", "Failed"})["status"]["phase"]
    out = logs(realcluster, realns, "client")
    assert phase == "Succeeded", out
    cluster_ip = realcluster.kubectl("get", "svc", "web", "-n", realns, "-o", "jsonpath={.spec.clusterIP}").stdout
    assert f"web {cluster_ip}" in out, out
    assert "kubernetes 10.96.0.1" in out, out
    assert "body hello-from-web" in out, out
    assert re.search(r"in-cluster client 10\.\d+\.\d+\.\d+", out), out
