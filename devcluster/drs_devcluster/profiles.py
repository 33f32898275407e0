"""Simulated GPU nodes of the dev cluster: the planner's profiles (``drs_operator.profiles``) made
into nodes kwok manages and the pod runner runs pods on.

Every node gets its own loopback InternalIP (``127.<net>.<1 + i // 250>.<1 + i % 250>``, never
127.0.0.1 which the control plane uses), its own pod CIDR (a /24 inside ``10.244.0.0/16``), the kwok
annotation and the ``disagg.dev/dev-node`` label, so that a process standing in for a host-network
pod can bind its node's address. ``drs plan --profile`` plans against the same shapes.
"""

from __future__ import annotations

import os
from typing import Any, Final

from drs_operator import profiles as shapes
from drs_operator.profiles import (
    CLIQUE_LABEL,
    DEFAULT_NODE_COUNT,
    GB200_NODES_PER_CLIQUE,
    GPU_COUNT_LABEL,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    MAX_NODES,
    PROFILES,
    ProfileError,
)

__all__ = [
    "CLIQUE_LABEL",
    "DEFAULT_NODE_COUNT",
    "DEV_NODE_LABEL",
    "GB200_NODES_PER_CLIQUE",
    "GPU_COUNT_LABEL",
    "GPU_PRODUCT_LABEL",
    "GPU_RESOURCE",
    "KWOK_NODE_ANNOTATION",
    "MAX_NODES",
    "NETWORK_POLICIES_ENV",
    "NODE_NET_ENV",
    "PROFILES",
    "ProfileError",
    "build_nodes",
    "network_policies",
    "node_ip",
    "node_net",
    "pod_cidr",
]

#: kwok manages the nodes carrying this annotation (kwok runs with a matching selector).
KWOK_NODE_ANNOTATION: Final = "kwok.x-k8s.io/node"
DEV_NODE_LABEL: Final = "disagg.dev/dev-node"

#: The second octet of every node address (``127.<net>.x.y``). Two dev clusters that run pods at
#: the same time (parallel test sessions, a person's ``drs dev up`` beside the suite) set different
#: values so their pods never bind the same address and port.
NODE_NET_ENV: Final = "DRS_DEV_NODE_NET"


def node_net() -> int:
    """The second octet of node addresses, from ``DRS_DEV_NODE_NET`` (0 to 255, default 0)."""
    raw = os.environ.get(NODE_NET_ENV, "0")
    if not raw.isdigit() or not 0 <= int(raw) <= 255:
        raise ProfileError(f"{NODE_NET_ENV} must be an integer between 0 and 255, got {raw!r}")
    return int(raw)


#: ``0`` runs real nodes without NetworkPolicy enforcement: kube-router is neither built nor started
#: (``make demo``, whose fleet has no NetworkPolicies, sets it so that a cold machine does not spend
#: minutes compiling kube-router). Default ``1``: enforced.
NETWORK_POLICIES_ENV: Final = "DRS_DEV_NETWORK_POLICIES"


def network_policies() -> bool:
    """Whether real nodes enforce NetworkPolicies (``DRS_DEV_NETWORK_POLICIES``: ``1``, the default, or ``0``)."""
    raw = os.environ.get(NETWORK_POLICIES_ENV, "1")
    if raw not in ("0", "1"):
        raise ProfileError(f"{NETWORK_POLICIES_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


def node_ip(index: int) -> str:
    """The loopback address of node ``index`` (127.0.1.1, 127.0.1.2, … with the default net 0)."""
    return f"127.{node_net()}.{1 + index // 250}.{1 + index % 250}"


def pod_cidr(index: int) -> str:
    """A /24 per node inside 10.244.0.0/16."""
    return f"10.244.{index % 256}.0/24"


def build_nodes(profile: str, count: int | None = None, first_index: int = 0) -> list[dict[str, Any]]:
    """The dev cluster's Node manifests for ``profile`` (see :func:`drs_operator.profiles.build_nodes`)."""
    nodes = shapes.build_nodes(profile, count, first_index, node_ip=node_ip)
    for offset, node in enumerate(nodes):
        index = first_index + offset
        node["metadata"]["labels"].update({"type": "kwok", DEV_NODE_LABEL: "true"})
        node["metadata"]["annotations"] = {KWOK_NODE_ANNOTATION: "fake"}
        node["spec"] = {"podCIDR": pod_cidr(index), "podCIDRs": [pod_cidr(index)]}
        node["status"]["nodeInfo"] = {
            "architecture": "amd64",
            "operatingSystem": "linux",
            "kubeletVersion": "fake",
            "kubeProxyVersion": "fake",
            "containerRuntimeVersion": "drs-sim://0",
            "kernelVersion": "",
            "osImage": "",
            "machineID": "",
            "systemUUID": "",
            "bootID": "",
        }
        node["status"]["phase"] = "Running"
    return nodes
