"""The operator's view of the cluster, served from watch caches (``kube/informer.py``).

Three kinds of watch, each narrowed on the server where the API allows it:

* **children**: Pods, Deployments, Services, ConfigMaps, Secrets and NetworkPolicies labelled
  ``disagg.dev/replicaset`` (label selector), in every served namespace (one watch per kind,
  cluster-wide or per namespace). Indexed by (namespace, owner name), so reading one resource's
  children costs its own children only. A change enqueues the owner (``on_owner``).
* **nodes**: all of them (any node may be a placement target), reduced to what placement reads
  (labels, taints, cordon, Ready and when it last changed, GPU allocatable, addresses). Only a
  change of that reduction enqueues every DisaggReplicaSet (``on_nodes``); heartbeats do not.
* **GPU pods**: pods bound to a node and not finished (field selector
  ``spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed``), cluster-wide, reduced to
  (node, GPUs, owner label) and kept only when they request GPUs. Per-node sums are kept as
  events arrive, so a reconcile's GPU accounting costs O(nodes), however many pods (GPU or not)
  the cluster runs.

Reconciles wait for every watch's first list (:meth:`ClusterCache.wait_synced`): a partial cache
would read as missing children (creates that answer 409) or missing nodes (replicas taken for
lost). Nothing here is the operator's memory: status is; a restarted operator lists again.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Final

from kubernetes_asyncio import client

from drs_operator.api.constants import (
    CHILD_KINDS,
    FRONTEND_PODS,
    GPU_RESOURCE,
    LABEL_REPLICASET,
    LABEL_ROLE,
    ROLE_FRONTEND,
)
from drs_operator.api.objects import Manifest
from drs_operator.kube.informer import Informer
from drs_operator.kube.observe import LiveChildren, owned_by
from drs_operator.nodepool import pod_gpus

#: Pods that hold GPUs: bound to a node and not finished.
BOUND_PODS: Final = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"


def _owner(obj: Manifest) -> tuple[str, str] | None:
    meta = obj.get("metadata") or {}
    owner = (meta.get("labels") or {}).get(LABEL_REPLICASET)
    return (str(meta.get("namespace") or ""), str(owner)) if owner else None


def project_node(node: Manifest) -> Manifest:
    """What placement (``nodepool.nodes_from_manifests``) reads of a Node; no heartbeat times."""
    meta, spec, status = node.get("metadata") or {}, node.get("spec") or {}, node.get("status") or {}
    gpus = (status.get("allocatable") or {}).get(GPU_RESOURCE)
    return {
        "kind": "Node",
        "metadata": {
            "name": meta.get("name"),
            "labels": meta.get("labels") or {},
            "resourceVersion": meta.get("resourceVersion"),
        },
        "spec": {"unschedulable": bool(spec.get("unschedulable")), "taints": spec.get("taints") or []},
        "status": {
            "allocatable": {GPU_RESOURCE: gpus} if gpus is not None else {},
            "conditions": [
                {
                    "type": c.get("type"),
                    "status": c.get("status"),
                    "reason": c.get("reason"),
                    "lastTransitionTime": c.get("lastTransitionTime"),
                }
                for c in status.get("conditions") or []
                if c.get("type") == "Ready"
            ],
            "addresses": status.get("addresses") or [],
        },
    }


def project_gpu_pod(pod: Manifest) -> Manifest | None:
    """(node, GPUs, owner label) of a bound pod, or None when it holds no GPU."""
    gpus = pod_gpus(pod)
    if gpus <= 0:
        return None
    meta = pod.get("metadata") or {}
    owner = (meta.get("labels") or {}).get(LABEL_REPLICASET)
    return {
        "metadata": {
            "namespace": meta.get("namespace"),
            "name": meta.get("name"),
            "resourceVersion": meta.get("resourceVersion"),
            "labels": {LABEL_REPLICASET: owner} if owner else {},
        },
        "spec": {"nodeName": (pod.get("spec") or {}).get("nodeName")},
        "gpus": gpus,
    }


def node_change_matters(old: Manifest | None, new: Manifest | None) -> bool:
    """Whether a node event changes what placement reads (not just its version or heartbeat)."""

    def strip(n: Manifest | None) -> Any:
        return None if n is None else {**n, "metadata": {**n["metadata"], "resourceVersion": None}}

    return bool(strip(old) != strip(new))


class GpuUsage:
    """GPUs held per node by bound pods, in total and per owning DisaggReplicaSet."""

    def __init__(self) -> None:
        self.total: collections.Counter[str] = collections.Counter()
        self.by_owner: dict[tuple[str, str], collections.Counter[str]] = collections.defaultdict(collections.Counter)

    def change(self, old: Manifest | None, new: Manifest | None) -> None:
        for pod, sign in ((old, -1), (new, 1)):
            if pod is None:
                continue
            node, gpus = pod["spec"]["nodeName"], sign * int(pod["gpus"])
            self.total[node] += gpus
            owner = _owner(pod)
            if owner is not None:
                self.by_owner[owner][node] += gpus

    def used_by_others(self, namespace: str, name: str) -> dict[str, int]:
        """GPUs per node held by pods that are not this DisaggReplicaSet's."""
        own = self.by_owner.get((namespace, name), collections.Counter())
        return {node: used - own[node] for node, used in self.total.items() if used - own[node] > 0}


class ClusterCache:
    """The watches the reconcile reads from. ``namespaces`` empty: every namespace."""

    def __init__(
        self,
        api: client.ApiClient,
        namespaces: Sequence[str],
        *,
        on_owner: Callable[[str, str], None],
        on_nodes: Callable[[], None],
        count_event: Callable[[str], None] | None = None,
        watch_timeout_s: int = 300,
    ) -> None:
        core, apps, networking = client.CoreV1Api(api), client.AppsV1Api(api), client.NetworkingV1Api(api)
        self.usage = GpuUsage()
        self._on_owner = on_owner
        self._on_nodes = on_nodes

        def counter(cache: str) -> Callable[[], None] | None:
            return (lambda: count_event(cache)) if count_event is not None else None

        cluster_wide: dict[str, Callable[..., Any]] = {
            "Pod": core.list_pod_for_all_namespaces,
            "Deployment": apps.list_deployment_for_all_namespaces,
            "Service": core.list_service_for_all_namespaces,
            "ConfigMap": core.list_config_map_for_all_namespaces,
            "Secret": core.list_secret_for_all_namespaces,
            "NetworkPolicy": networking.list_network_policy_for_all_namespaces,
        }
        namespaced: dict[str, Callable[..., Any]] = {
            "Pod": core.list_namespaced_pod,
            "Deployment": apps.list_namespaced_deployment,
            "Service": core.list_namespaced_service,
            "ConfigMap": core.list_namespaced_config_map,
            "Secret": core.list_namespaced_secret,
            "NetworkPolicy": networking.list_namespaced_network_policy,
        }
        self.children: dict[str, dict[str | None, Informer]] = {}
        for kind in CHILD_KINDS:
            listers: dict[str | None, Callable[..., Any]] = (
                {ns: functools.partial(namespaced[kind], ns) for ns in namespaces}
                if namespaces
                else {None: cluster_wide[kind]}
            )
            self.children[kind] = {
                ns: Informer(
                    kind,
                    lister,
                    label_selector=LABEL_REPLICASET,
                    index=_owner_index,
                    on_change=self._child_changed,
                    on_event=counter(kind),
                    watch_timeout_s=watch_timeout_s,
                )
                for ns, lister in listers.items()
            }
        self.nodes = Informer(
            "Node",
            core.list_node,
            project=project_node,
            on_change=self._node_changed,
            on_event=counter("Node"),
            watch_timeout_s=watch_timeout_s,
        )
        self.gpu_pods = Informer(
            "Pod",
            core.list_pod_for_all_namespaces,
            field_selector=BOUND_PODS,
            project=project_gpu_pod,
            on_change=self.usage.change,
            on_event=counter("GpuPod"),
            watch_timeout_s=watch_timeout_s,
        )

    @property
    def informers(self) -> list[Informer]:
        return [*(i for by_ns in self.children.values() for i in by_ns.values()), self.nodes, self.gpu_pods]

    async def run(self) -> None:
        """List and watch everything until cancelled."""
        await asyncio.gather(*(i.run() for i in self.informers))

    async def wait_synced(self) -> None:
        for informer in self.informers:
            await informer.synced.wait()

    # ------------------------------------------------------------------ reads
    def informer(self, kind: str, namespace: str) -> Informer | None:
        by_ns = self.children.get(kind) or {}
        return by_ns.get(namespace) or by_ns.get(None)

    def live_children(self, namespace: str, name: str, uid: str) -> LiveChildren:
        """Children of one DisaggReplicaSet whose controller is this UID, by kind then name."""
        by_kind: dict[str, dict[str, Manifest]] = {}
        for kind in CHILD_KINDS:
            informer = self.informer(kind, namespace)
            objs = informer.by_index((namespace, name)) if informer is not None else {}
            by_kind[kind] = {key[1]: obj for key, obj in objs.items() if owned_by(obj, uid)}
            if kind == "Pod":  # its frontends' pods, whose controller is their Deployment's ReplicaSet
                by_kind[FRONTEND_PODS] = {key[1]: obj for key, obj in objs.items() if _frontend_pod(obj)}
        return LiveChildren(by_kind)

    def node_manifests(self) -> list[Manifest]:
        return list(self.nodes.store.values())

    # ------------------------------------------------------------------ events
    def _child_changed(self, old: Manifest | None, new: Manifest | None) -> None:
        owner = _owner(new or old or {})
        if owner is not None:
            self._on_owner(*owner)

    def _node_changed(self, old: Manifest | None, new: Manifest | None) -> None:
        if node_change_matters(old, new):
            self._on_nodes()


def _frontend_pod(obj: Manifest) -> bool:
    meta = obj.get("metadata") or {}
    refs = meta.get("ownerReferences") or []
    role = (meta.get("labels") or {}).get(LABEL_ROLE)
    return role == ROLE_FRONTEND and any(r.get("kind") == "ReplicaSet" and r.get("controller") for r in refs)


def _owner_index(obj: Manifest) -> Hashable | None:
    return _owner(obj)
