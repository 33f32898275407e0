"""The leader's view of its Ray cluster: connect as a driver, see which ranks joined, disconnect.

Ray's Python API blocks, so the leader calls these in a thread. ``ray`` is imported here only, so
an engine of one pod never imports it.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Final

from drs_protocol.gang import rank_resource

#: The Ray namespace of the engine's actors.
NAMESPACE: Final = "drs"


@dataclass(frozen=True)
class JoinedNode:
    rank: int
    node_ip: str
    node_id: str
    gpus: int


def connect(address: str, host: str) -> None:
    """Attach this process to the head at ``address`` as a driver (no logs forwarded, no dashboard)."""
    ray = importlib.import_module("ray")
    ray.init(
        address=address,
        _node_ip_address=host,
        namespace=NAMESPACE,
        log_to_driver=False,
        logging_level=logging.WARNING,
        ignore_reinit_error=True,
    )


def disconnect() -> None:
    ray = importlib.import_module("ray")
    if ray.is_initialized():
        ray.shutdown()


def joined_nodes(world_size: int) -> dict[int, JoinedNode]:
    """The alive Ray nodes that carry a rank's resource, by rank (a rank joined twice: the newest)."""
    ray: Any = importlib.import_module("ray")
    out: dict[int, JoinedNode] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        resources: dict[str, Any] = node.get("Resources") or {}
        for rank in range(world_size):
            if resources.get(rank_resource(rank)):
                out[rank] = JoinedNode(
                    rank=rank,
                    node_ip=str(node.get("NodeManagerAddress")),
                    node_id=str(node.get("NodeID")),
                    gpus=int(resources.get("GPU", 0)),
                )
    return out
