"""Per-replica engine NetworkPolicies (``spec.networkPolicy``) on the real control plane (kwok nodes).

The apiserver stores and serves them; nothing here enforces them (kwok runs no CNI, and the dev
cluster's bridge CNI enforces no NetworkPolicy): what is tested is that the operator creates one
per replica, owned by the DisaggReplicaSet, selecting exactly that replica's engine pods, and
prunes them when the flag is turned off or the fleet scales down; and that a peer of
``engineClients`` that selects no pod is reported (``PolicyPeersMatch``) while the fleet serves.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from drs_devcluster.testing import RunningCluster
from operator_harness import OperatorProcess, apply, condition, drs_status, get_json, pods, wait_for, wait_ready

pytestmark = pytest.mark.cluster

SIDECAR = {"podSelector": {"matchLabels": {"app": "trainer-sidecar"}}, "namespaceSelector": {}}


def fleet(replicas: int, **network_policy: Any) -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggReplicaSet",
        "metadata": {"name": "netpol"},
        "spec": {
            "replicas": replicas,
            "model": {"path": "/models/m"},
            "prefill": {"engines": 1, "tensorParallelSize": 2},
            "decode": {"engines": 1, "tensorParallelSize": 2},
            "frontend": {"workers": 1, "basePort": 9400},
            "topology": {"gpusPerNode": 8},
            "networkPolicy": network_policy,
        },
    }


def policies(devcluster: RunningCluster, namespace: str) -> dict[str, dict[str, Any]]:
    items = get_json(devcluster, "networkpolicies", "-n", namespace)["items"]
    return {p["metadata"]["name"]: p for p in items if not p["metadata"].get("deletionTimestamp")}


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions") or [])


def test_one_policy_per_replica_selects_its_engines_and_goes_when_scaled_down_or_turned_off(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    apply(devcluster, namespace, fleet(2, enabled=True, engineClients=[SIDECAR]))
    wait_ready(devcluster, namespace, "netpol", 2)
    live = wait_for(
        "a NetworkPolicy per replica",
        lambda: (p := policies(devcluster, namespace)) and set(p) == {"netpol-r0-engines", "netpol-r1-engines"} and p,
    )
    uid = get_json(devcluster, "drs", "-n", namespace, "netpol")["metadata"]["uid"]
    running = [p for p in pods(devcluster, namespace) if not p["metadata"].get("deletionTimestamp")]
    for r in (0, 1):
        policy = live[f"netpol-r{r}-engines"]
        [ref] = policy["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("DisaggReplicaSet", uid, True)
        selected = {
            p["metadata"]["name"] for p in running if matches(policy["spec"]["podSelector"], p["metadata"]["labels"])
        }
        assert selected == {f"netpol-r{r}-prefill-0", f"netpol-r{r}-decode-0"}
        own, peers, sidecar = policy["spec"]["ingress"][0]["from"]
        admitted = {p["metadata"]["name"] for p in running if matches(own["podSelector"], p["metadata"]["labels"])}
        assert admitted == selected | {
            p["metadata"]["name"] for p in running if p["metadata"]["name"].startswith(f"netpol-r{r}-f0-")
        }
        # the fleet's engines of every replica (a path-less catch-up's peers), no frontend
        engines = {p["metadata"]["name"] for p in running if matches(peers["podSelector"], p["metadata"]["labels"])}
        assert engines == {f"netpol-r{i}-{role}-0" for i in (0, 1) for role in ("prefill", "decode")}
        assert sidecar == SIDECAR

    devcluster.kubectl("scale", "drs", "netpol", "-n", namespace, "--replicas=1")
    wait_ready(devcluster, namespace, "netpol", 1)
    wait_for("replica 1's policy to be pruned", lambda: set(policies(devcluster, namespace)) == {"netpol-r0-engines"})

    patch = {"spec": {"networkPolicy": {"enabled": False}}}
    devcluster.kubectl("patch", "drs", "netpol", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    wait_for("every policy to be pruned", lambda: policies(devcluster, namespace) == {})
    prefill = pods(devcluster, namespace, "disagg.dev/role=prefill")
    assert [p["metadata"]["name"] for p in prefill if not p["metadata"].get("deletionTimestamp")] == [
        "netpol-r0-prefill-0"
    ]  # turning the policies off left the engines alone


def pending_pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
    """A pod no node takes (its nodeSelector matches none): it exists, so a selector selects it."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {"nodeSelector": {"disagg.dev/no-such-node": "true"}, "containers": [{"name": "c", "image": "none"}]},
    }


def test_a_peer_that_selects_nothing_is_a_condition_and_a_warning_naming_it_until_a_pod_matches(
    devcluster: RunningCluster, namespace: str, operator: OperatorProcess
) -> None:
    elsewhere = f"{namespace}-trainer"
    lonely = {"podSelector": {"matchLabels": {"app": "trainer-sidecar"}}}
    gone = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": elsewhere}}}
    apply(
        devcluster, namespace, fleet(1, enabled=True, engineClients=[lonely, {"ipBlock": {"cidr": "10.0.0.0/8"}}, gone])
    )
    wait_ready(devcluster, namespace, "netpol", 1)

    def peers(status: str) -> dict[str, Any] | None:
        found = condition(drs_status(devcluster, namespace, "netpol"), "PolicyPeersMatch")
        return found if found.get("status") == status else None

    cond = wait_for("PolicyPeersMatch=False", lambda: peers("False"))
    first = f"spec.networkPolicy.engineClients[0]: podSelector 'app=trainer-sidecar' selects no pod in namespace {namespace}"
    third = (
        f"spec.networkPolicy.engineClients[2]: namespaceSelector 'kubernetes.io/metadata.name={elsewhere}' "
        "selects no namespace"
    )
    assert cond["reason"] == "PolicyPeerSelectsNothing" and first in cond["message"] and third in cond["message"]
    assert "engineClients[1]" not in cond["message"], "an ipBlock is not checked"
    warnings = [
        e for e in get_json(devcluster, "events", "-n", namespace)["items"] if e["reason"] == "PolicyPeerSelectsNothing"
    ]
    assert warnings and warnings[0]["type"] == "Warning" and first in warnings[0]["message"]
    status = drs_status(devcluster, namespace, "netpol")
    assert status["readyReplicas"] == 1 and condition(status, "Ready")["status"] == "True"  # still serving
    assert len(policies(devcluster, namespace)["netpol-r0-engines"]["spec"]["ingress"][0]["from"]) == 5

    devcluster.kubectl("create", "namespace", elsewhere)
    try:
        apply(devcluster, namespace, pending_pod("sidecar", {"app": "trainer-sidecar"}))
        apply(devcluster, elsewhere, pending_pod("trainer", {"app": "trainer"}))
        cond = wait_for("PolicyPeersMatch=True once both select a pod", lambda: peers("True"), timeout=90)
        assert cond["reason"] == "PolicyPeersMatchPods" and "(2 checked)" in cond["message"]
        reasons = {e["reason"] for e in get_json(devcluster, "events", "-n", namespace)["items"]}
        assert "PolicyPeersMatchPods" in reasons
    finally:
        devcluster.kubectl("delete", "namespace", elsewhere, "--wait=false")
