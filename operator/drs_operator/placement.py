"""``place(plan, nodes, previous)``: which nodes every engine and frontend of a plan runs on.

Pure: nodes come in as :class:`NodeInfo` (``nodepool.nodes_from_manifests`` builds them from Node
and Pod manifests); the result is a :class:`Placement`. Nothing here talks to Kubernetes.

Nodes
    A node is *usable* when it is schedulable (Ready, not cordoned, matching
    ``topology.nodeSelector``, its NoSchedule/NoExecute taints tolerated), has GPUs, has exactly
    ``topology.gpusPerNode`` GPUs when that is set, and its size is tiled by the replica's engine
    widths (``plan.tiling_problem``: packed node by node, no engine crosses a node boundary).
    Others are listed in ``Placement.excluded`` with the reason. ``free`` GPUs are allocatable
    minus what pods that are not ours request, so our own engines never count against us. A node
    that is not Ready but within its toleration (``NodeInfo.tolerated_until``) keeps the replicas
    placed on it and takes no new one (its free GPUs count as 0 after step 1).

Algorithm
    1. Sticky: in replica order, a replica of ``previous`` keeps its nodes when its engines are
       unchanged (names, widths), every node is still usable (or tolerated) and the free GPUs
       still hold it (what an earlier kept replica took is gone: no node is ever promised twice).
    2. What our own pods still hold on nodes their replica is not kept on (``held``) is not
       free for any *other* replica (the replica itself may use it again), and a node that is
       not Ready but tolerated offers nothing new.
    3. The other replicas, in order, each placed whole (gang) in the first tier that works
       (:mod:`drs_operator.packing`):
       a. one node: the tightest fit (fewest free GPUs left, then name);
       b. one segment: the segment whose packing uses the fewest nodes (then tightest, then name);
       c. split across segments (``split=True``, with a reason).
       Inside a node set, an engine wider than a node takes ``width / node size`` whole free
       nodes of one segment (by name); the other engines are packed into the fewest nodes,
       found exactly (the k nodes with the most free GPUs are tried for k = 1, 2, …, each by an
       exhaustive search with best-fit order). A replica that fits nowhere gets no nodes and a
       reason naming the shortfall (computed after every replica was placed, so placing twice
       gives the same words).
    4. Frontend ``f`` of a replica runs on ``nodes[f % len(nodes)]``, where ``nodes`` are the
       replica's distinct engine nodes in slot order.

Invariants (tested by hypothesis): no engine straddles a node (an engine is on one node, or on
whole nodes of one segment); no node gets more GPUs than it has free, counting what other
replicas' live pods still hold there (no node's GPUs are double-booked, however nodes flap); the output is a function
of the input (candidates sorted by name); ``place(plan, nodes, place(plan, nodes, p))`` equals
``place(plan, nodes, p)``, because kept replicas are kept and every tier's feasibility test is
exact, so a replica that failed with more free GPUs fails again with fewer.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from drs_operator.api.constants import Role
from drs_operator.api.status import ReplicaStatus
from drs_operator.packing import Assignment, Pool, engine_demand, place_replica, replica_demand
from drs_operator.plan import Plan, ReplicaPlan, tiling_problem


@dataclass(frozen=True)
class NodeInfo:
    """What placement needs to know about a node."""

    name: str
    allocatable: int  #: GPUs
    free: int  #: allocatable minus GPUs requested by pods that are not ours
    segment: str  #: the value of ``topology.segmentLabel``, or the node's name without it
    schedulable: bool = True
    unschedulable_reason: str | None = None
    address: str | None = None  #: InternalIP (host networking URLs)
    #: Not schedulable only because it is not Ready, within ``topology.notReadyTolerationSeconds``:
    #: replicas already there stay until then; no replica is newly placed there.
    tolerated_until: datetime.datetime | None = None


@dataclass(frozen=True)
class EnginePlacement:
    name: str
    replica: int
    role: Role
    ordinal: int
    width: int
    nodes: tuple[str, ...]  #: one node, or the whole nodes (rank order) of an engine wider than a node

    @property
    def node(self) -> str | None:
        """The node of rank 0 (the pod serving HTTP)."""
        return self.nodes[0] if self.nodes else None


@dataclass(frozen=True)
class FrontendPlacement:
    replica: int
    index: int
    port: int
    node_id: int
    node: str | None


@dataclass(frozen=True)
class ReplicaPlacement:
    index: int
    placed: bool
    engines: tuple[EnginePlacement, ...]  #: with ``nodes=()`` when not placed
    frontends: tuple[FrontendPlacement, ...]  #: with ``node=None`` when not placed
    segments: tuple[str, ...] = ()  #: sorted
    split: bool = False
    reason: str | None = None  #: why split, why not placed, or until when it waits on a node that is not Ready

    @property
    def nodes(self) -> tuple[str, ...]:
        """Distinct engine nodes in slot order (frontends go round-robin over these)."""
        return tuple(dict.fromkeys(n for e in self.engines for n in e.nodes))

    @property
    def segment(self) -> str | None:
        """The one segment holding the replica (``None`` when split or not placed)."""
        return self.segments[0] if len(self.segments) == 1 else None


@dataclass(frozen=True)
class Placement:
    replicas: tuple[ReplicaPlacement, ...]
    excluded: tuple[tuple[str, str], ...] = ()  #: (node, why it is not used), by node name

    @property
    def complete(self) -> bool:
        return all(r.placed for r in self.replicas)

    @property
    def unplaced(self) -> tuple[ReplicaPlacement, ...]:
        return tuple(r for r in self.replicas if not r.placed)

    @property
    def split(self) -> tuple[ReplicaPlacement, ...]:
        return tuple(r for r in self.replicas if r.split)

    def replica(self, index: int) -> ReplicaPlacement:
        return next(r for r in self.replicas if r.index == index)


# --- the algorithm --------------------------------------------------------------------------
#: GPUs held on a node by live pods of ours, per replica index: node -> replica -> GPUs.
Held = Mapping[str, Mapping[int, int]]


def place(
    plan: Plan, nodes: Iterable[NodeInfo], previous: Placement | None = None, held: Held | None = None
) -> Placement:
    """Place every replica of ``plan`` on ``nodes``, keeping ``previous`` where it still holds.

    ``held``: GPUs our live pods hold per node and replica. ``NodeInfo.free`` leaves our pods out;
    pods on a node their replica is not kept on (moved or unplaced, terminating, written by a pass
    whose status write was lost, scaled away) hold those GPUs from every other replica.
    """
    usable, excluded = _usable(plan, sorted(nodes, key=lambda n: n.name))
    segments: dict[str, list[str]] = {}
    for n in usable:
        segments.setdefault(n.segment, []).append(n.name)
    pool = Pool(
        size={n.name: n.allocatable for n in usable},
        segment={n.name: n.segment for n in usable},
        names=tuple(n.name for n in usable),
        segments={s: tuple(v) for s, v in sorted(segments.items())},
    )
    free = {n.name: max(0, min(n.free, n.allocatable)) for n in usable}
    chosen: dict[int, Assignment] = {}

    kept = {r.index: r for r in previous.replicas if r.placed} if previous is not None else {}
    for rep in plan.replicas:
        old = kept.get(rep.index)
        if old is not None:
            assignment = {e.name: e.nodes for e in old.engines}
            if _holds(rep, assignment, pool, free):
                chosen[rep.index] = assignment
                _take(rep, assignment, pool, free)
    strays = _strays(held or {}, chosen, free)
    waiting = {n.name: n.tolerated_until for n in usable if not n.schedulable and n.tolerated_until is not None}
    free.update(dict.fromkeys(waiting, 0))  # a node that is not Ready keeps what it has, takes nothing new
    for rep in plan.replicas:
        if rep.index not in chosen:
            found = place_replica(rep, pool, _available(free, strays, rep.index))
            if found is not None:
                chosen[rep.index] = found
                for node, gpus in replica_demand(rep, found, pool).items():
                    free[node] -= gpus
                    mine = strays.get(node, {})
                    if rep.index in mine:  # its new engines there supersede its old pods
                        mine[rep.index] = max(0, mine[rep.index] - gpus)
    free = _available(free, strays, None)

    replicas = tuple(
        _waiting(_result(rep, chosen.get(rep.index), pool, free, bool(usable), excluded), waiting)
        for rep in plan.replicas
    )
    return Placement(replicas=replicas, excluded=tuple(excluded))


def _strays(held: Held, chosen: Mapping[int, Assignment], free: Mapping[str, int]) -> dict[str, dict[int, int]]:
    """What our pods hold on (usable) nodes their replica is not kept on: node -> replica -> GPUs."""
    strays: dict[str, dict[int, int]] = {}
    for node, by_replica in held.items():
        if node not in free:
            continue
        kept_here = {r for r, assignment in chosen.items() if any(node in ns for ns in assignment.values())}
        mine = {r: gpus for r, gpus in by_replica.items() if r not in kept_here and gpus > 0}
        if mine:
            strays[node] = mine
    return strays


def _available(free: Mapping[str, int], strays: Mapping[str, Mapping[int, int]], replica: int | None) -> dict[str, int]:
    """Free GPUs for ``replica``: what every *other* replica's pods still hold is taken (a
    replica's own pods hold GPUs it may use again)."""
    return {n: max(0, f - sum(g for r, g in strays.get(n, {}).items() if r != replica)) for n, f in free.items()}


def _usable(plan: Plan, nodes: Sequence[NodeInfo]) -> tuple[list[NodeInfo], list[tuple[str, str]]]:
    usable: list[NodeInfo] = []
    excluded: list[tuple[str, str]] = []
    tiles: dict[int, str | None] = {}
    widths = plan.replica_widths
    for n in nodes:
        if not n.schedulable and n.tolerated_until is None:
            excluded.append((n.name, n.unschedulable_reason or "not schedulable"))
        elif n.allocatable <= 0:
            excluded.append((n.name, "no allocatable GPUs"))
        elif plan.gpus_per_node is not None and n.allocatable != plan.gpus_per_node:
            excluded.append((n.name, f"{n.allocatable} GPUs, but topology.gpusPerNode is {plan.gpus_per_node}"))
        else:
            if n.allocatable not in tiles:
                problem = tiling_problem(widths, n.allocatable)
                tiles[n.allocatable] = None if problem is None else str(problem)
            why = tiles[n.allocatable]
            if why is None:
                usable.append(n)
            else:
                excluded.append((n.name, why))
    return usable, excluded


def _holds(rep: ReplicaPlan, assignment: Assignment, pool: Pool, free: Mapping[str, int]) -> bool:
    """Whether ``assignment`` (from a previous placement) is still good for ``rep``."""
    if set(assignment) != {e.name for e in rep.engines}:
        return False
    need: dict[str, int] = {}
    for e in rep.engines:
        demand = engine_demand(e.width, assignment[e.name], pool)
        if demand is None:
            return False
        for n, g in demand.items():
            need[n] = need.get(n, 0) + g
    return all(free[n] >= g for n, g in need.items())


def _take(rep: ReplicaPlan, assignment: Assignment, pool: Pool, free: dict[str, int]) -> None:
    for n, g in replica_demand(rep, assignment, pool).items():
        free[n] -= g


def _result(
    rep: ReplicaPlan,
    assignment: Assignment | None,
    pool: Pool,
    free: Mapping[str, int],
    any_usable: bool,
    excluded: Sequence[tuple[str, str]],
) -> ReplicaPlacement:
    if assignment is None:
        engines = tuple(EnginePlacement(e.name, e.replica, e.role, e.ordinal, e.width, ()) for e in rep.engines)
        frontends = tuple(FrontendPlacement(f.replica, f.index, f.port, f.node_id, None) for f in rep.frontends)
        why = _shortfall(rep, pool, free) if any_usable else _no_nodes(rep, excluded)
        return ReplicaPlacement(rep.index, False, engines, frontends, reason=why)
    engines = tuple(
        EnginePlacement(e.name, e.replica, e.role, e.ordinal, e.width, assignment[e.name]) for e in rep.engines
    )
    nodes = tuple(dict.fromkeys(n for e in engines for n in e.nodes))
    frontends = tuple(
        FrontendPlacement(f.replica, f.index, f.port, f.node_id, nodes[f.index % len(nodes)]) for f in rep.frontends
    )
    segments = tuple(sorted({pool.segment[n] for n in nodes}))
    if len(segments) == 1:
        return ReplicaPlacement(rep.index, True, engines, frontends, segments)
    why = (
        f"replica {rep.index} is split across {len(segments)} segments ({', '.join(segments)}): no single node or "
        f"segment had {rep.width} free GPUs for it, so its KV transfers cross a segment boundary"
    )
    return ReplicaPlacement(rep.index, True, engines, frontends, segments, split=True, reason=why)


def _waiting(rp: ReplicaPlacement, waiting: Mapping[str, datetime.datetime]) -> ReplicaPlacement:
    """A replica kept on nodes that are not Ready says until when it waits there."""
    held = [n for n in rp.nodes if n in waiting]
    if not rp.placed or not held:
        return rp
    until = min(waiting[n] for n in held).strftime("%Y-%m-%dT%H:%M:%SZ")
    why = (
        f"replica {rp.index} stays on {', '.join(held)} (not Ready) until {until} "
        "(topology.notReadyTolerationSeconds), then moves"
    )
    return dataclasses.replace(rp, reason=why if rp.reason is None else f"{rp.reason}; {why}")


def _widths(rep: ReplicaPlan) -> str:
    return "+".join(str(e.width) for e in rep.engines)


def _no_nodes(rep: ReplicaPlan, excluded: Sequence[tuple[str, str]]) -> str:
    if not excluded:
        return f"replica {rep.index} needs {rep.width} GPUs (engines {_widths(rep)}); there are no nodes"
    reasons = sorted({why for _, why in excluded})
    return f"replica {rep.index} needs {rep.width} GPUs (engines {_widths(rep)}); no node is usable: " + "; ".join(
        reasons
    )


def _shortfall(rep: ReplicaPlan, pool: Pool, free: Mapping[str, int]) -> str:
    """Why ``rep`` does not fit, against the free GPUs left after every placement."""
    largest = max(pool.size.values())
    for e in rep.engines:
        if e.width > largest:
            counts: dict[tuple[str, int], int] = {}
            for n in pool.names:
                if e.width % pool.size[n] == 0 and free[n] == pool.size[n]:
                    key = (pool.segment[n], pool.size[n])
                    counts[key] = counts.get(key, 0) + 1
            best = max(sorted(counts.items()), key=lambda kv: kv[1], default=None)
            have = (
                f"most in one segment: {best[1]} free {best[0][1]}-GPU nodes in {best[0][0]}"
                if best
                else "no node is wholly free"
            )
            return (
                f"replica {rep.index} cannot be placed: engine {e.name} (width {e.width}) needs whole free nodes "
                f"of one segment, {e.width} GPUs in all; {have}"
            )
    top = min(pool.names, key=lambda n: (-free[n], n))
    total = sum(free.values())
    return (
        f"replica {rep.index} needs {rep.width} GPUs in one node or segment (engines {_widths(rep)}) and cannot be "
        f"split either; largest free: {free[top]} on node {top}; {total} free on {len(pool.names)} usable nodes"
    )


# --- the sticky input from status -----------------------------------------------------------
def previous_from_status(statuses: Iterable[ReplicaStatus]) -> Placement:
    """The sticky input for :func:`place`, rebuilt from ``status.replicaStatuses``."""
    replicas = []
    for rs in statuses:
        engines = tuple(
            EnginePlacement(e.name, rs.index, e.role, e.ordinal, e.width, tuple(e.nodes)) for e in rs.engines
        )
        placed = rs.placed and all(e.nodes for e in engines)
        replicas.append(ReplicaPlacement(rs.index, placed, engines, ()))
    return Placement(replicas=tuple(replicas))
