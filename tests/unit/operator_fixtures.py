"""Builders shared by the operator's pure unit tests: specs, node pools, desired and "live" children."""

from __future__ import annotations

import copy
from typing import Any

from drs_devcluster.profiles import build_nodes
from drs_operator.api.spec import DisaggReplicaSetSpec
from drs_operator.conditions import Observed
from drs_operator.layout import frontend_urls, replica_statuses
from drs_operator.manifests import Owner, desired_children
from drs_operator.manifests.children import Children
from drs_operator.nodepool import nodes_from_manifests
from drs_operator.placement import NodeInfo, Placement, place
from drs_operator.plan import Plan, plan

OWNER = Owner(name="fleet", namespace="ns", uid="uid-1")


def spec(**overrides: Any) -> DisaggReplicaSetSpec:
    body: dict[str, Any] = {
        "replicas": 2,
        "model": {"path": "/models/m"},
        "prefill": {"engines": 1, "tensorParallelSize": 4},
        "decode": {"engines": 2, "tensorParallelSize": 2},
        "frontend": {"workers": 2, "basePort": 8300},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(body.get(key), dict):
            body[key] = {**body[key], **value}
        else:
            body[key] = value
    return DisaggReplicaSetSpec.model_validate(body)


def hgx(count: int = 4) -> list[NodeInfo]:
    return nodes_from_manifests(build_nodes("hgx", count))


def build(
    s: DisaggReplicaSetSpec, nodes: list[NodeInfo] | None = None, previous: Placement | None = None
) -> tuple[Plan, Placement, Children]:
    nodes = nodes if nodes is not None else hgx()
    p = plan(s, OWNER.name)
    placement = place(p, nodes, previous)
    addresses = {n.name: n.address for n in nodes if n.address}
    return p, placement, desired_children(OWNER, s, p, placement, addresses)


def observed_fleet(nodes: int = 4) -> tuple[Children, Observed]:
    """The default spec on ``nodes`` HGX nodes: its children and what a pass observes of them (no live objects)."""
    p, placement, desired = build(spec(), hgx(nodes))
    addresses = {n.name: n.address or "" for n in hgx(nodes)}
    observed = Observed(
        generation=1,
        replica_statuses=replica_statuses(p, placement, OWNER.namespace, addresses),
        urls=frontend_urls(p, placement, OWNER.namespace, addresses),
        replica_width=p.replica_width,
        gpus=p.gpus,
        desired=desired,
    )
    return desired, observed


def as_live(children: Children, ready: bool = True) -> dict[str, dict[str, dict[str, Any]]]:
    """What the apiserver would hold once everything was created (pods bound and, if asked, ready)."""
    live: dict[str, dict[str, dict[str, Any]]] = {}
    for kind in ("Pod", "Deployment", "Service", "ConfigMap", "NetworkPolicy"):
        live[kind] = {}
        for name, obj in children.all_of(kind).items():
            o = copy.deepcopy(obj)
            o["metadata"]["resourceVersion"] = "1"
            o["metadata"]["generation"] = 1
            if kind == "Pod":
                node = o["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
                    "nodeSelectorTerms"
                ][0]["matchFields"][0]["values"][0]
                o["spec"]["nodeName"] = node
                o["status"] = {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                }
            if kind == "Deployment":
                o["status"] = {"observedGeneration": 1, "readyReplicas": 1 if ready else 0, "updatedReplicas": 1}
            live[kind][name] = o
    return live
