"""``decide``: steps 3-5 of a reconcile pass as one pure function (plan, place, desire, compare).

Given a valid spec, the previous status (the placement is read back from it: status is the
operator's memory), the nodes and the live children, it returns the plan, the placement, the
desired children, the actions that reach them and the :class:`~drs_operator.conditions.Observed`
that ``compute_status`` turns into the new status. ``reconcile`` calls it between reading and
writing; the unit tests call the same function, so they exercise the operator's own wiring.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence

from drs_protocol.weights_state import DesiredWeights, HeldWeights

from drs_operator.api.constants import LABEL_REPLICA
from drs_operator.api.objects import Manifest
from drs_operator.api.spec import DisaggReplicaSetSpec
from drs_operator.api.status import DisaggReplicaSetStatus
from drs_operator.conditions import Observed
from drs_operator.layout import frontend_urls, replica_statuses
from drs_operator.manifests import Owner, desired_children
from drs_operator.manifests.children import Children
from drs_operator.manifests.policies import OperatorPods
from drs_operator.nodepool import pod_gpus
from drs_operator.placement import NodeInfo, Placement, place, previous_from_status
from drs_operator.plan import Plan
from drs_operator.plan import plan as make_plan
from drs_operator.rollout import Rollout, compute_actions


@dataclasses.dataclass(frozen=True)
class Decision:
    plan: Plan
    placement: Placement
    desired: Children
    rollout: Rollout
    moved: list[int]  #: replicas placed before that now sit on other nodes
    observed: Observed
    #: The earliest end of a not-Ready node's toleration that holds a replica (look again then).
    tolerated_until: datetime.datetime | None = None


def decide(
    spec: DisaggReplicaSetSpec,
    owner: Owner,
    previous: DisaggReplicaSetStatus,
    nodes: Sequence[NodeInfo],
    live: Mapping[str, Mapping[str, Manifest]],
    *,
    generation: int,
    weights_version: str | None = None,
    engine_weights: Mapping[str, HeldWeights] | None = None,
    desired_weights: DesiredWeights | None = None,
    operator: OperatorPods | None = None,
) -> Decision:
    """Plan, place (sticky on the placement recorded in ``previous``), desire and compare."""
    plan = make_plan(spec, owner.name)
    addresses = {n.name: n.address for n in nodes if n.address}
    prior = previous_from_status(previous.replica_statuses) if previous.replica_statuses else None
    placement = place(plan, list(nodes), prior, held_by_replica(live.get("Pod", {})))
    usable = {n.name for n in nodes if n.schedulable or n.tolerated_until is not None}
    lost = {n for rs in previous.replica_statuses for n in rs.nodes if n not in usable}
    moved = moved_replicas(prior, placement)
    desired = desired_children(owner, spec, plan, placement, addresses, desired_weights, operator)
    rollout = compute_actions(desired, live, lost, [r.index for r in plan.replicas])
    observed = Observed(
        generation=generation,
        replica_statuses=replica_statuses(plan, placement, owner.namespace, addresses),
        urls=frontend_urls(plan, placement, owner.namespace, addresses),
        replica_width=plan.replica_width,
        gpus=plan.gpus,
        desired=desired,
        live=live,
        rollout=rollout,
        moved=moved,
        weights_version=weights_version,
        engine_weights=dict(engine_weights or {}),
        desired_weights=desired_weights,
        frontend_standby=spec.frontend_standby,
        host_network=spec.network.host_network,
    )
    held = {n for r in placement.replicas if r.placed for n in r.nodes}
    until = min((n.tolerated_until for n in nodes if n.name in held and n.tolerated_until is not None), default=None)
    return Decision(plan, placement, desired, rollout, moved, observed, until)


def held_by_replica(pods: Mapping[str, Manifest]) -> dict[str, dict[int, int]]:
    """GPUs our live engine pods hold, per node and replica: bound and not finished, terminating
    ones included (a draining engine still has its GPUs)."""
    held: dict[str, dict[int, int]] = {}
    for pod in pods.values():
        node = (pod.get("spec") or {}).get("nodeName")
        label = str(((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_REPLICA) or "")
        finished = (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")
        gpus = pod_gpus(pod)
        if node and label.isdigit() and not finished and gpus > 0:
            by_replica = held.setdefault(str(node), {})
            by_replica[int(label)] = by_replica.get(int(label), 0) + gpus
    return held


def moved_replicas(prior: Placement | None, placement: Placement) -> list[int]:
    """Replicas that were placed before and now sit on other nodes."""
    if prior is None:
        return []
    before = {r.index: r.nodes for r in prior.replicas if r.placed}
    return [r.index for r in placement.replicas if r.placed and r.index in before and r.nodes != before[r.index]]
