"""The placed plan as the trainer and a person see it: URLs and ``status.replicaStatuses``.

* Pod networking: a frontend's URL is its Service, ``http://<drs>-r<r>-f<f>.<ns>.svc:<port>``,
  and an engine's is its pod under the headless Service,
  ``http://<pod>.<drs>-engines.<ns>.svc:<port>``; both are known before placement and stable for
  the life of the resource.
* Host networking: ``http://<node address>:<port>`` of the node the frontend or engine was
  placed on (``None`` until placed); it changes only when the replica moves off a lost node.

``frontend_urls`` is replica-major (r0f0, r0f1, …, r1f0, …) and has N×F entries: the order is
the client's contract (``sha256(session) % len(urls)``). A replica that is not placed has no
frontend and no Service, so its entries are ``None`` (``""`` in status) in both networking modes:
the list keeps its length, so placing or losing one replica never re-hashes the sessions of the
others (which would throw away every conversation's prefix-cache affinity), and a client sees at
once that nothing listens there instead of resolving a Service that does not exist. ``replica_statuses`` writes the
placement in the status shape (``placement.previous_from_status`` reads it back).
"""

from __future__ import annotations

from collections.abc import Mapping

from drs_operator.api import names
from drs_operator.api.status import EngineStatus, FrontendStatus, RankStatus, ReplicaStatus
from drs_operator.placement import Placement
from drs_operator.plan import EngineSlot, Plan


def frontend_urls(
    plan: Plan, placement: Placement | None, namespace: str, addresses: Mapping[str, str]
) -> list[str | None]:
    """The N×F frontend URLs, replica-major. Pod networking: the frontend Service's DNS name
    (known before placement; ``None`` once a placement says the replica is not placed); host
    networking: the placed node's address (``None`` until placed)."""
    out: list[str | None] = []
    unplaced = {r.index for r in placement.replicas if not r.placed} if placement is not None else set()
    for f in plan.frontends:
        if f.replica in unplaced:  # no frontend, no Service: nothing answers there
            out.append(None)
            continue
        if not plan.host_network:
            out.append(names.url(names.frontend_host(plan.name, namespace, f.replica, f.index), f.port))
            continue
        node = _frontend_node(placement, f.replica, f.index)
        address = addresses.get(node) if node else None
        out.append(names.url(address, f.port) if address else None)
    return out


def engine_url(
    plan: Plan, engine: EngineSlot, node: str | None, namespace: str, addresses: Mapping[str, str]
) -> str | None:
    """An engine's base URL: its pod's DNS name under the headless Service, or ``nodeIP:port``."""
    if not plan.host_network:
        return names.url(names.engine_host(plan.name, namespace, engine.name), engine.port)
    address = addresses.get(node) if node else None
    return names.url(address, engine.port) if address else None


def _frontend_node(placement: Placement | None, replica: int, index: int) -> str | None:
    if placement is None:
        return None
    for r in placement.replicas:
        if r.index == replica:
            return next((f.node for f in r.frontends if f.index == index), None)
    return None


def rank_statuses(drs: str, engine: EngineSlot, nodes: tuple[str, ...]) -> list[RankStatus]:
    """The pods of an engine placed on several ``nodes`` (rank order), none joined yet."""
    return [
        RankStatus(
            rank=rank, pod=names.engine_pod_name(drs, engine.replica, engine.role, engine.ordinal, rank), node=node
        )
        for rank, node in enumerate(nodes)
    ]


def replica_statuses(
    plan: Plan, placement: Placement, namespace: str, addresses: Mapping[str, str]
) -> list[ReplicaStatus]:
    """The placement in ``status.replicaStatuses`` shape, every ``ready`` False (the operator sets those)."""
    urls = frontend_urls(plan, placement, namespace, addresses)
    slots = {e.name: e for e in plan.engines}
    out: list[ReplicaStatus] = []
    for rp in placement.replicas:
        engines = [
            EngineStatus(
                name=e.name,
                role=e.role,
                ordinal=e.ordinal,
                width=e.width,
                nodes=list(e.nodes),
                node=e.node,
                url=engine_url(plan, slots[e.name], e.node, namespace, addresses) if rp.placed else None,
                ranks=rank_statuses(plan.name, slots[e.name], e.nodes) if len(e.nodes) > 1 else None,
            )
            for e in rp.engines
        ]
        frontends = [
            FrontendStatus(
                index=f.index,
                url=urls[f.replica * plan.frontends_per_replica + f.index],
                port=f.port,
                node_id=f.node_id,
                node=f.node,
            )
            for f in rp.frontends
        ]
        out.append(
            ReplicaStatus(
                index=rp.index,
                placed=rp.placed,
                nodes=list(rp.nodes),
                segment=rp.segment,
                split=rp.split,
                reason=rp.reason,
                engines=engines,
                frontends=frontends,
            )
        )
    return out
