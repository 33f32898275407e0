"""The contract of an engine wider than a node: one engine over several pods, launched as a gang.

The operator renders one pod per node of such an engine (rank 0 serves HTTP; ranks 1..W-1 serve
nothing but their Ray node) and gives every pod ``drs_protocol.env``'s ``RANK``, ``WORLD_SIZE``,
``LEADER_ADDRESS``, ``RANK_GPUS`` and ``RAY_PORT``; the engine's leader (rank 0) starts the Ray
head and the other ranks join it. This module holds the rest of that contract, imported by both
sides (the operator's manifests, the engine's gang launcher): the Ray port rule, the rank
resource and the shape of the leader's ``GET /v1/gang`` report.

Ray port: pod networking gives every pod its own address, so every leader uses
:data:`DEFAULT_RAY_PORT`. With host networking a wide engine owns its nodes' GPUs, but a node may
still run other processes of the fleet (frontends), so the leader's Ray port follows the engine's
own port (:func:`ray_port_for`), which the plan already keeps unique per engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, TypedDict

#: Ray head port with pod networking.
DEFAULT_RAY_PORT: Final = 6379
#: With host networking the Ray head listens this far above the engine's HTTP port.
RAY_PORT_OFFSET: Final = 1000
MAX_PORT: Final = 65535

#: Phases of a gang, in order; ``failed`` ends the leader (its pod restarts, and the ranks with it).
PHASES: Final = ("starting", "joining", "loading", "serving", "failed")


def ray_port_for(engine_port: int, host_network: bool) -> int:
    """The leader's Ray port: :data:`DEFAULT_RAY_PORT`, or the engine port ± :data:`RAY_PORT_OFFSET` (host networking)."""
    if not host_network:
        return DEFAULT_RAY_PORT
    up = engine_port + RAY_PORT_OFFSET
    return up if up <= MAX_PORT else engine_port - RAY_PORT_OFFSET


def rank_resource(rank: int) -> str:
    """The Ray custom resource a rank's node declares (one unit), so bundles can be pinned to it."""
    return f"drs_rank_{rank}"


class RankReport(TypedDict):
    rank: int
    node_ip: str | None  #: the address its Ray node registered with, once joined
    joined: bool  #: its Ray node is alive in the leader's cluster
    gpus: int  #: GPUs its node declared to Ray
    workers_alive: int  #: engine workers (one per GPU) alive on it


class GangReport(TypedDict):
    world_size: int
    session: str  #: changes with every start of the leader (a rank seeing another one rejoins)
    ray_address: str
    phase: str  #: one of :data:`PHASES`
    ranks: list[RankReport]
    reason: str  #: what the gang waits for, or why it failed


def parse_gang_report(data: Any) -> GangReport:
    """A :class:`GangReport` from JSON, or ``ValueError`` naming the field that is wrong."""
    if not isinstance(data, Mapping):
        raise ValueError("gang report: not a JSON object")
    for key, kind in (("world_size", int), ("session", str), ("ray_address", str), ("phase", str), ("reason", str)):
        if not isinstance(data.get(key), kind):
            raise ValueError(f"gang report: {key} must be {kind.__name__}")
    if data["phase"] not in PHASES:
        raise ValueError(f"gang report: phase must be one of {', '.join(PHASES)}, got {data['phase']!r}")
    ranks = data.get("ranks")
    if not isinstance(ranks, list):
        raise ValueError("gang report: ranks must be a list")
    out: list[RankReport] = []
    for i, r in enumerate(ranks):
        if not isinstance(r, Mapping) or not isinstance(r.get("rank"), int) or not isinstance(r.get("joined"), bool):
            raise ValueError(f"gang report: ranks[{i}] needs an integer rank and a boolean joined")
        node_ip = r.get("node_ip")
        out.append(
            RankReport(
                rank=int(r["rank"]),
                node_ip=str(node_ip) if node_ip is not None else None,
                joined=bool(r["joined"]),
                gpus=int(r.get("gpus") or 0),
                workers_alive=int(r.get("workers_alive") or 0),
            )
        )
    return GangReport(
        world_size=int(data["world_size"]),
        session=str(data["session"]),
        ray_address=str(data["ray_address"]),
        phase=str(data["phase"]),
        ranks=out,
        reason=str(data["reason"]),
    )
