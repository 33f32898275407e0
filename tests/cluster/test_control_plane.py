"""The test bed itself: each real component does its job on the simulated GPU nodes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from drs_devcluster import profiles
from drs_devcluster.testing import TEST_GB200_NODES, TEST_HGX_NODES, RunningCluster, wait_for

pytestmark = pytest.mark.cluster


def get(devcluster: RunningCluster, *args: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(devcluster.kubectl("get", *args, "-o", "json").stdout)
    return out


def gpu_pod(name: str, gpus: int, node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "engine", "image": "sim", "resources": {"limits": {profiles.GPU_RESOURCE: str(gpus)}}}]
    }
    if node:
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                }
            }
        }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_simulated_gpu_nodes_carry_capacity_addresses_and_cliques(devcluster: RunningCluster) -> None:
    nodes = get(devcluster, "nodes")["items"]
    assert len(nodes) == TEST_HGX_NODES + TEST_GB200_NODES
    ips = [a["address"] for n in nodes for a in n["status"]["addresses"] if a["type"] == "InternalIP"]
    assert sorted(ips) == sorted(profiles.node_ip(i) for i in range(len(nodes)))  # 127.<DRS_DEV_NODE_NET>.x.y
    assert "127.0.0.1" not in ips
    by_gpus: dict[str, int] = {}
    for n in nodes:
        gpus = n["status"]["allocatable"][profiles.GPU_RESOURCE]
        by_gpus[gpus] = by_gpus.get(gpus, 0) + 1
        ready = [c for c in n["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", n["metadata"]["name"]
        assert n["spec"]["podCIDR"]
    assert by_gpus == {"8": TEST_HGX_NODES, "4": TEST_GB200_NODES}
    cliques = {
        n["metadata"]["labels"].get(profiles.CLIQUE_LABEL) for n in nodes if n["metadata"]["name"].startswith("gb200")
    }
    assert cliques == {"nvl72-0", "nvl72-1"}
    assert all(
        profiles.CLIQUE_LABEL not in n["metadata"]["labels"] for n in nodes if n["metadata"]["name"].startswith("hgx")
    )


def test_scheduler_binds_a_gpu_pod_to_its_affine_node_and_kwok_runs_it(
    devcluster: RunningCluster, namespace: str
) -> None:
    target = "hgx-003"
    devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(gpu_pod("four-gpus", 4, target)))

    def running() -> dict[str, Any] | None:
        pod = get(devcluster, "pod", "-n", namespace, "four-gpus")
        return pod if pod["status"].get("phase") == "Running" else None

    pod = wait_for("the pod to run", running)
    assert pod["spec"]["nodeName"] == target
    assert pod["status"]["hostIP"] == next(
        a["address"] for a in get(devcluster, "node", target)["status"]["addresses"] if a["type"] == "InternalIP"
    )


def test_a_pod_wanting_more_gpus_than_any_node_stays_pending_with_the_schedulers_reason(
    devcluster: RunningCluster, namespace: str
) -> None:
    devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(gpu_pod("too-big", 16, None)))

    def unschedulable() -> dict[str, Any] | None:
        pod = get(devcluster, "pod", "-n", namespace, "too-big")
        conds = [c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"]
        return conds[0] if conds and conds[0].get("reason") == "Unschedulable" else None

    cond = wait_for("the scheduler to give up", unschedulable)
    assert "Insufficient nvidia.com/gpu" in cond["message"]
    assert get(devcluster, "pod", "-n", namespace, "too-big")["status"]["phase"] == "Pending"


def test_controller_manager_turns_a_deployment_into_a_running_pod(devcluster: RunningCluster, namespace: str) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {"containers": [{"name": "web", "image": "sim"}]},
            },
        },
    }
    devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(deployment))

    def available() -> bool:
        status = get(devcluster, "deployment", "-n", namespace, "web").get("status", {})
        return bool(status.get("availableReplicas") == 1)

    wait_for("the deployment to become available", available)
    pods = get(devcluster, "pods", "-n", namespace, "-l", "app=web")["items"]
    assert [p["status"]["phase"] for p in pods] == ["Running"]


def test_garbage_collector_deletes_what_an_owner_owned(devcluster: RunningCluster, namespace: str) -> None:
    devcluster.kubectl("create", "configmap", "owner", "-n", namespace)
    owner = get(devcluster, "configmap", "-n", namespace, "owner")["metadata"]
    owned = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "owned",
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["uid"]}],
        },
    }
    devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(owned))
    devcluster.kubectl("delete", "configmap", "owner", "-n", namespace)

    def gone() -> bool:
        return devcluster.kubectl("get", "configmap", "owned", "-n", namespace, check=False).returncode != 0

    wait_for("the owned ConfigMap to be garbage-collected", gone)


CEL_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.celtest.disagg.dev"},
    "spec": {
        "group": "celtest.disagg.dev",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {"min": {"type": "integer"}, "max": {"type": "integer"}},
                                "x-kubernetes-validations": [
                                    {"rule": "self.min <= self.max", "message": "spec.min must not exceed spec.max"}
                                ],
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_apiserver_enforces_a_crd_cel_rule_at_create_time(devcluster: RunningCluster, namespace: str) -> None:
    devcluster.kubectl("apply", "-f", "-", input=json.dumps(CEL_CRD))
    devcluster.kubectl("wait", "--for=condition=Established", "crd/widgets.celtest.disagg.dev", "--timeout=60s")

    def widget(lo: int, hi: int, name: str) -> str:
        return json.dumps(
            {
                "apiVersion": "celtest.disagg.dev/v1",
                "kind": "Widget",
                "metadata": {"name": name},
                "spec": {"min": lo, "max": hi},
            }
        )

    good = wait_for(
        "the new type to be served",
        lambda: (
            devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget(1, 2, "good"), check=False).returncode
            == 0
        ),
    )
    assert good
    bad = devcluster.kubectl("apply", "-n", namespace, "-f", "-", input=widget(3, 2, "bad"), check=False)
    assert bad.returncode != 0
    assert "spec.min must not exceed spec.max" in bad.stderr
    assert devcluster.kubectl("get", "widget", "bad", "-n", namespace, check=False).returncode != 0
