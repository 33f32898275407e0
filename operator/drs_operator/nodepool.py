"""The node pool placement sees: :class:`~drs_operator.placement.NodeInfo` from Node and Pod manifests.

Pure (manifests in, data out), so ``drs plan --nodes`` and the operator (which lists live Nodes
and Pods) compute the same thing:

* ``allocatable``: the node's ``status.allocatable["nvidia.com/gpu"]``;
* ``free``: allocatable minus the GPUs requested by pods bound to the node that are not finished
  and not ours; a pod's request is the larger of its containers' sum and its largest init
  container;
* ``segment``: the value of ``topology.segmentLabel``, else the node's own name;
* ``schedulable``: not cordoned, Ready (a manifest without conditions counts as Ready), matching
  ``topology.nodeSelector``, and every NoSchedule/NoExecute taint tolerated by
  ``topology.tolerations``; otherwise ``unschedulable_reason`` says which;
* ``tolerated_until`` (only given ``now``): for a node that is unschedulable *only* because it is
  not Ready (its Ready condition is False or Unknown, or the node lifecycle controller's
  ``node.kubernetes.io/not-ready`` / ``unreachable`` taints are still on it), the moment
  ``topology.notReadyTolerationSeconds`` after it stopped being Ready (the Ready condition's
  ``lastTransitionTime``; for a lingering taint its ``timeAdded``), while that is still ahead:
  a replica placed there stays until then, as a pod tolerates those taints for
  ``tolerationSeconds`` before it is evicted;
* ``address``: InternalIP, else ExternalIP, else Hostname.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from drs_operator.api.constants import GPU_RESOURCE, LABEL_REPLICASET, NODE_NOT_READY_TAINTS
from drs_operator.api.spec import Toleration, TopologySpec
from drs_operator.placement import NodeInfo


def nodes_from_manifests(
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]] = (),
    *,
    topology: TopologySpec | None = None,
    owner: tuple[str, str] | None = None,
    used: Mapping[str, int] | None = None,
    now: datetime.datetime | None = None,
) -> list[NodeInfo]:
    """:class:`NodeInfo` for Node manifests (as ``kubectl get nodes -o yaml`` prints them).

    ``free`` subtracts the GPUs requested by ``pods`` bound to the node that are still running
    and not ours (``owner`` is our (namespace, name): pods labelled ``disagg.dev/replicaset`` with
    our name in our namespace are ours), or, when given, ``used``: those GPUs already summed per
    node (the operator keeps the sums as watch events arrive). A node without a Ready condition
    (a bare manifest) is taken as Ready. Without ``now`` no node is tolerated (``drs plan``).
    """
    topo = topology or TopologySpec()
    taken = dict(used) if used is not None else _used_by_others(pods, owner)
    out: list[NodeInfo] = []
    for node in nodes:
        meta = node.get("metadata") or {}
        name = str(meta.get("name", ""))
        labels = meta.get("labels") or {}
        status = node.get("status") or {}
        allocatable = _quantity((status.get("allocatable") or {}).get(GPU_RESOURCE))
        why = _unschedulable(node, labels, topo)
        until = _tolerated_until(node, labels, topo, now) if why is not None and now is not None else None
        out.append(
            NodeInfo(
                name=name,
                allocatable=allocatable,
                free=max(0, allocatable - taken.get(name, 0)),
                segment=str(labels.get(topo.segment_label) or name),
                schedulable=why is None,
                unschedulable_reason=why,
                address=_address(status),
                tolerated_until=until,
            )
        )
    return out


def _used_by_others(pods: Iterable[Mapping[str, Any]], owner: tuple[str, str] | None) -> dict[str, int]:
    """GPUs per node held by bound, unfinished pods that are not ``owner``'s."""
    used: dict[str, int] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase in ("Succeeded", "Failed"):
            continue
        if (
            owner is not None
            and meta.get("namespace") == owner[0]
            and (meta.get("labels") or {}).get(LABEL_REPLICASET) == owner[1]
        ):
            continue
        used[node] = used.get(node, 0) + pod_gpus(pod)
    return used


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """GPUs a pod requests: the larger of its containers' sum and its largest init container."""
    spec = pod.get("spec") or {}

    def gpus(container: Mapping[str, Any]) -> int:
        resources = container.get("resources") or {}
        for key in ("requests", "limits"):
            value = (resources.get(key) or {}).get(GPU_RESOURCE)
            if value is not None:
                return _quantity(value)
        return 0

    regular = sum(gpus(c) for c in spec.get("containers") or [])
    init = max((gpus(c) for c in spec.get("initContainers") or []), default=0)
    return max(regular, init)


def _quantity(value: Any) -> int:
    if value is None:
        return 0
    try:
        return int(str(value))
    except ValueError:
        return 0


def _unschedulable(
    node: Mapping[str, Any], labels: Mapping[str, str], topo: TopologySpec, *, ignore_not_ready: bool = False
) -> str | None:
    """Why ``node`` takes no replica (``None``: it does). ``ignore_not_ready`` leaves out the Ready
    condition and the node lifecycle controller's not-ready/unreachable taints."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable"):
        return "cordoned (spec.unschedulable)"
    ready = _ready_condition(node)
    if not ignore_not_ready and ready is not None and ready.get("status") != "True":
        return f"not Ready ({ready.get('reason') or ready.get('status')})"
    for key, value in (topo.node_selector or {}).items():
        if labels.get(key) != value:
            return f"does not match topology.nodeSelector {key}={value}"
    for taint in spec.get("taints") or []:
        if ignore_not_ready and taint.get("key") in NODE_NOT_READY_TAINTS:
            continue
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(taint, topo.tolerations or []):
            return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} is not tolerated"
    return None


def _ready_condition(node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            found: Mapping[str, Any] = cond
            return found
    return None


def _tolerated_until(
    node: Mapping[str, Any], labels: Mapping[str, str], topo: TopologySpec, now: datetime.datetime
) -> datetime.datetime | None:
    """Until when a replica already on ``node`` stays there although it is not Ready (see the
    module docstring); ``None`` when something else makes it unusable, or the grace has run out."""
    grace = topo.not_ready_toleration_seconds
    if grace <= 0 or _unschedulable(node, labels, topo, ignore_not_ready=True) is not None:
        return None
    ready = _ready_condition(node)
    if ready is not None and ready.get("status") != "True":
        since = _time(ready.get("lastTransitionTime"))
    else:  # Ready again, the lifecycle taints not yet removed: since they were added
        added = [
            _time(t.get("timeAdded")) or now
            for t in (node.get("spec") or {}).get("taints") or []
            if t.get("key") in NODE_NOT_READY_TAINTS
        ]
        since = min(added, default=now)
    if since is None:
        return None
    until = since + datetime.timedelta(seconds=grace)
    return until if until > now else None


def _time(value: Any) -> datetime.datetime | None:
    """An RFC 3339 timestamp as the API writes it, or ``None``."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=datetime.UTC)


def _tolerated(taint: Mapping[str, Any], tolerations: Sequence[Toleration]) -> bool:
    for t in tolerations:
        if t.effect is not None and t.effect != taint.get("effect"):
            continue
        if t.key is None and t.operator == "Exists":
            return True
        if t.key != taint.get("key"):
            continue
        if t.operator == "Exists" or (t.value or "") == (taint.get("value") or ""):
            return True
    return False


def _address(status: Mapping[str, Any]) -> str | None:
    addresses = {a.get("type"): a.get("address") for a in status.get("addresses") or []}
    for kind in ("InternalIP", "ExternalIP", "Hostname"):
        if addresses.get(kind):
            return str(addresses[kind])
    return None
