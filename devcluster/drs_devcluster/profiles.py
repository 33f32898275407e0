"""Simulated GPU node profiles: pure functions that return Kubernetes Node manifests.

* ``hgx``: 8-GPU nodes (``nvidia.com/gpu: 8``) with no clique label: the node is the NVLink domain.
* ``gb200``: 4-GPU nodes, 18 per NVL72 domain, each labelled ``nvidia.com/gpu.clique``.
* ``mixed``: the first half hgx nodes, the rest gb200 nodes (a partial clique when fewer than 18).

Every node gets its own loopback InternalIP (``127.0.<1 + i // 250>.<1 + i % 250>``, never
127.0.0.1 which the control plane uses) and its own pod CIDR (a /24 inside ``10.244.0.0/16``), so
that a process standing in for a host-network pod can bind its node's address. The same manifests feed ``drs dev up`` (which
creates them) and ``drs plan --profile`` (which plans against them without a cluster).
"""

from __future__ import annotations

import os
from typing import Any, Final

GPU_RESOURCE: Final = "nvidia.com/gpu"
GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
GPU_COUNT_LABEL: Final = "nvidia.com/gpu.count"
CLIQUE_LABEL: Final = "nvidia.com/gpu.clique"
#: kwok manages the nodes carrying this annotation (kwok runs with a matching selector).
KWOK_NODE_ANNOTATION: Final = "kwok.x-k8s.io/node"
DEV_NODE_LABEL: Final = "disagg.dev/dev-node"

PROFILES: Final = ("hgx", "gb200", "mixed")
DEFAULT_NODE_COUNT: Final = {"hgx": 4, "gb200": 18, "mixed": 8}
GB200_NODES_PER_CLIQUE: Final = 18
MAX_NODES: Final = 2000

_HGX = {"gpus": 8, "product": "NVIDIA-H100-80GB-HBM3", "cpu": "192", "memory": "2015Gi"}
_GB200 = {"gpus": 4, "product": "NVIDIA-GB200", "cpu": "144", "memory": "1800Gi"}


class ProfileError(ValueError):
    """An unknown profile or a bad node count; the message names the rule."""


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


def node_ip(index: int) -> str:
    """The loopback address of node ``index`` (127.0.1.1, 127.0.1.2, … with the default net 0)."""
    return f"127.{node_net()}.{1 + index // 250}.{1 + index % 250}"


def pod_cidr(index: int) -> str:
    """A /24 per node inside 10.244.0.0/16."""
    return f"10.244.{index % 256}.0/24"


def build_nodes(profile: str, count: int | None = None, first_index: int = 0) -> list[dict[str, Any]]:
    """Node manifests for ``profile`` (``count`` defaults per profile).

    ``first_index`` offsets the node addresses and pod CIDRs, so that nodes of a second call
    (another profile added to the same cluster) get addresses of their own.
    """
    if profile not in PROFILES:
        raise ProfileError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)}")
    n = DEFAULT_NODE_COUNT[profile] if count is None else count
    if not 1 <= n <= MAX_NODES or first_index + n > MAX_NODES:
        raise ProfileError(f"--nodes must be between 1 and {MAX_NODES}, got {n}")
    nodes: list[dict[str, Any]] = []
    for i in range(n):
        kind = profile if profile != "mixed" else ("hgx" if i < (n + 1) // 2 else "gb200")
        if kind == "hgx":
            nodes.append(_node(f"hgx-{i:03d}", first_index + i, _HGX, clique=None))
        else:
            j = i if profile == "gb200" else i - (n + 1) // 2
            clique = f"nvl72-{j // GB200_NODES_PER_CLIQUE}"
            nodes.append(_node(f"gb200-{j:03d}", first_index + i, _GB200, clique=clique))
    return nodes


def _node(name: str, index: int, shape: dict[str, Any], clique: str | None) -> dict[str, Any]:
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "type": "kwok",
        DEV_NODE_LABEL: "true",
        GPU_PRODUCT_LABEL: str(shape["product"]),
        GPU_COUNT_LABEL: str(shape["gpus"]),
    }
    if clique is not None:
        labels[CLIQUE_LABEL] = clique
    resources = {"cpu": shape["cpu"], "memory": shape["memory"], "pods": "110", GPU_RESOURCE: str(shape["gpus"])}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": {KWOK_NODE_ANNOTATION: "fake"}},
        "spec": {"podCIDR": pod_cidr(index), "podCIDRs": [pod_cidr(index)]},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "addresses": [{"type": "InternalIP", "address": node_ip(index)}, {"type": "Hostname", "address": name}],
            "nodeInfo": {
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
            },
            "phase": "Running",
        },
    }
