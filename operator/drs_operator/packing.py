"""Packing one replica's engines into nodes: the node sets and the exact search of ``place``.

Pure, and below :mod:`drs_operator.placement` (which imports this module, never the reverse).
:func:`place_replica` tries the tiers in order — one node (tightest fit), one segment (fewest
nodes, then tightest, then name), split across segments — and :func:`pack` fills one node set:
an engine wider than a node takes ``width / node size`` whole free nodes of one segment (by name);
the other engines go into the fewest nodes, found exactly (the k nodes with the most free GPUs are
tried for k = 1, 2, …, each by :func:`search`, depth-first with best fit first, equal remaining
capacities tried once, failed states remembered, at most ``SEARCH_BUDGET`` steps).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from drs_operator.plan import EngineSlot, ReplicaPlan

#: Upper bound on search steps for one packing (far above what real fleets need).
SEARCH_BUDGET = 200_000

#: Where a replica's engines run: engine name -> its nodes (one, or whole nodes in rank order).
Assignment = dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Pool:
    """The usable nodes, indexed (built by ``place``)."""

    size: Mapping[str, int]
    segment: Mapping[str, str]
    names: tuple[str, ...]  # sorted
    segments: Mapping[str, tuple[str, ...]]  # segment -> its nodes, sorted


def engine_demand(width: int, nodes: Sequence[str], pool: Pool) -> dict[str, int] | None:
    """GPUs an engine takes per node, or ``None`` if ``nodes`` cannot hold it."""
    if not nodes or any(n not in pool.size for n in nodes) or len(set(nodes)) != len(nodes):
        return None
    if len(nodes) == 1 and width <= pool.size[nodes[0]]:
        return {nodes[0]: width}
    size = pool.size[nodes[0]]
    if width <= size or width % size or len(nodes) != width // size:
        return None
    if any(pool.size[n] != size or pool.segment[n] != pool.segment[nodes[0]] for n in nodes):
        return None
    return dict.fromkeys(nodes, size)


def replica_demand(rep: ReplicaPlan, assignment: Assignment, pool: Pool) -> dict[str, int]:
    """GPUs ``rep`` takes per node under ``assignment``."""
    booked: dict[str, int] = {}
    for e in rep.engines:
        demand = engine_demand(e.width, assignment[e.name], pool)
        assert demand is not None
        for n, g in demand.items():
            booked[n] = booked.get(n, 0) + g
    return booked


def place_replica(rep: ReplicaPlan, pool: Pool, free: Mapping[str, int]) -> Assignment | None:
    """``rep`` whole in the first tier that holds it (one node, one segment, split), or ``None``."""
    width = rep.width
    widest = max((e.width for e in rep.engines), default=0)
    # a. one node, tightest fit
    fits = [n for n in pool.names if free[n] >= width and pool.size[n] >= widest]
    if fits:
        node = min(fits, key=lambda n: (free[n], n))
        return {e.name: (node,) for e in rep.engines}
    # b. one segment, fewest nodes, then tightest, then name
    best: tuple[tuple[int, int, str], Assignment] | None = None
    for segment, members in pool.segments.items():
        if sum(free[n] for n in members) < width:
            continue
        found = pack(rep.engines, members, pool, free)
        if found is not None:
            used = {n for ns in found.values() for n in ns}
            key = (len(used), sum(free[n] for n in used), segment)
            if best is None or key < best[0]:
                best = (key, found)
    if best is not None:
        return best[1]
    # c. split across segments
    return pack(rep.engines, pool.names, pool, free)


def pack(
    engines: Sequence[EngineSlot], members: Sequence[str], pool: Pool, free: Mapping[str, int]
) -> Assignment | None:
    """Engines into ``members``: wide ones on whole free nodes of one segment, the rest into the fewest nodes."""
    local = {n: free[n] for n in members}
    largest = max((pool.size[n] for n in members), default=0)
    out: Assignment = {}
    for e in engines:
        if e.width <= largest:
            continue
        whole = whole_nodes(e.width, members, pool, local)
        if whole is None:
            return None
        out[e.name] = whole
        for n in whole:
            local[n] = 0
    small = sorted((e for e in engines if e.width <= largest), key=lambda e: (-e.width, e.index))
    if not small:
        return out
    candidates = sorted((n for n in members if local[n] > 0), key=lambda n: (-local[n], n))
    if sum(local[n] for n in candidates) < sum(e.width for e in small):
        return None
    for k in range(1, min(len(small), len(candidates)) + 1):
        bins = candidates[:k]
        slots = search([e.width for e in small], [local[n] for n in bins])
        if slots is not None:
            out.update({e.name: (bins[b],) for e, b in zip(small, slots, strict=True)})
            return out
    return None


def whole_nodes(width: int, members: Sequence[str], pool: Pool, local: Mapping[str, int]) -> tuple[str, ...] | None:
    """``width / size`` fully free nodes of one size and one segment (first segment by name)."""
    groups: dict[tuple[str, int], list[str]] = {}
    for n in members:
        size = pool.size[n]
        if width % size == 0 and local[n] == size:
            groups.setdefault((pool.segment[n], size), []).append(n)
    for (_, size), nodes in sorted(groups.items()):
        if len(nodes) >= width // size:
            return tuple(sorted(nodes)[: width // size])
    return None


def search(widths: Sequence[int], caps: Sequence[int]) -> list[int] | None:
    """Exact: a bin for every width (sorted descending) within ``caps``, or ``None``.

    Depth-first, best fit first; bins with equal remaining capacity are tried once; failed
    states are remembered. Gives up (``None``) after ``SEARCH_BUDGET`` steps.
    """
    remaining = list(caps)
    slots = [0] * len(widths)
    failed: set[tuple[int, tuple[int, ...]]] = set()
    steps = 0

    def go(i: int) -> bool:
        nonlocal steps
        if i == len(widths):
            return True
        state = (i, tuple(sorted(remaining)))
        if state in failed:
            return False
        steps += 1
        if steps > SEARCH_BUDGET:
            return False
        w = widths[i]
        tried: set[int] = set()
        for b in sorted(range(len(remaining)), key=lambda b: (remaining[b] - w, b)):
            cap = remaining[b]
            if cap < w or cap in tried:
                continue
            tried.add(cap)
            remaining[b] -= w
            slots[i] = b
            if go(i + 1):
                return True
            remaining[b] += w
        failed.add(state)
        return False

    return slots if go(0) else None
