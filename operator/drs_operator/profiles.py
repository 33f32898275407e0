"""GPU node profiles the planner can lay a fleet on without a cluster (``drs plan --profile``).

* ``hgx``: 8-GPU nodes (``nvidia.com/gpu: 8``) with no clique label: the node is the NVLink domain.
* ``gb200``: 4-GPU nodes, 18 per NVL72 domain, each labelled ``nvidia.com/gpu.clique``.
* ``mixed``: the first half hgx nodes, the rest gb200 nodes (a partial clique when fewer than 18).

:func:`build_nodes` returns plain Node manifests (capacity, GPU labels, an address per node from
``node_ip``). The dev cluster (``drs_devcluster.profiles``) builds its simulated nodes from the same
function, adding what kwok and the pod runner need.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from drs_operator.api.constants import DEFAULT_SEGMENT_LABEL, GPU_RESOURCE
from drs_operator.api.objects import Manifest

GPU_PRODUCT_LABEL: Final = "nvidia.com/gpu.product"
GPU_COUNT_LABEL: Final = "nvidia.com/gpu.count"
#: The NVLink domain of a GB200 node (the label the planner groups segments by, by default).
CLIQUE_LABEL: Final = DEFAULT_SEGMENT_LABEL

__all__ = [
    "CLIQUE_LABEL",
    "DEFAULT_NODE_COUNT",
    "GB200_NODES_PER_CLIQUE",
    "GPU_COUNT_LABEL",
    "GPU_PRODUCT_LABEL",
    "GPU_RESOURCE",
    "MAX_NODES",
    "PROFILES",
    "ProfileError",
    "build_nodes",
    "loopback_ip",
]

PROFILES: Final = ("hgx", "gb200", "mixed")
DEFAULT_NODE_COUNT: Final = {"hgx": 4, "gb200": 18, "mixed": 8}
GB200_NODES_PER_CLIQUE: Final = 18
MAX_NODES: Final = 2000

_HGX = {"gpus": 8, "product": "NVIDIA-H100-80GB-HBM3", "cpu": "192", "memory": "2015Gi"}
_GB200 = {"gpus": 4, "product": "NVIDIA-GB200", "cpu": "144", "memory": "1800Gi"}


class ProfileError(ValueError):
    """An unknown profile or a bad node count; the message names the rule."""


def loopback_ip(index: int) -> str:
    """Node ``index``'s address when none is given: 127.0.1.1, 127.0.1.2, …"""
    return f"127.0.{1 + index // 250}.{1 + index % 250}"


def build_nodes(
    profile: str, count: int | None = None, first_index: int = 0, node_ip: Callable[[int], str] = loopback_ip
) -> list[Manifest]:
    """Node manifests for ``profile`` (``count`` defaults per profile).

    ``first_index`` offsets the node addresses (``node_ip(index)``), so that nodes of a second call
    (another profile added to the same cluster) get addresses of their own.
    """
    if profile not in PROFILES:
        raise ProfileError(f"unknown profile {profile!r}: choose one of {', '.join(PROFILES)}")
    n = DEFAULT_NODE_COUNT[profile] if count is None else count
    if not 1 <= n <= MAX_NODES or first_index + n > MAX_NODES:
        raise ProfileError(f"--nodes must be between 1 and {MAX_NODES}, got {n}")
    nodes: list[Manifest] = []
    for i in range(n):
        kind = profile if profile != "mixed" else ("hgx" if i < (n + 1) // 2 else "gb200")
        if kind == "hgx":
            nodes.append(_node(f"hgx-{i:03d}", node_ip(first_index + i), _HGX, clique=None))
        else:
            j = i if profile == "gb200" else i - (n + 1) // 2
            clique = f"nvl72-{j // GB200_NODES_PER_CLIQUE}"
            nodes.append(_node(f"gb200-{j:03d}", node_ip(first_index + i), _GB200, clique=clique))
    return nodes


def _node(name: str, address: str, shape: dict[str, Any], clique: str | None) -> Manifest:
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        GPU_PRODUCT_LABEL: str(shape["product"]),
        GPU_COUNT_LABEL: str(shape["gpus"]),
    }
    if clique is not None:
        labels[CLIQUE_LABEL] = clique
    resources = {"cpu": shape["cpu"], "memory": shape["memory"], "pods": "110", GPU_RESOURCE: str(shape["gpus"])}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": labels},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            "addresses": [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}],
        },
    }
