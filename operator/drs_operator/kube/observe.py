"""Read what exists: the DisaggReplicaSet, its children, the nodes and the GPUs other pods use.

Everything is read fresh at the start of every reconcile (level-based: the reconcile never trusts
the event that triggered it). Children are found by the ``disagg.dev/replicaset`` label and kept
only if their controller ownerReference is this resource's UID, so objects of a deleted namesake
waiting for garbage collection are never adopted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from drs_operator.api.constants import GROUP, LABEL_REPLICASET, PLURAL, VERSION
from drs_operator.kube.client import REQUEST_TIMEOUT_S, as_json

Manifest = dict[str, Any]
CHILD_KINDS = ("Pod", "Deployment", "Service", "ConfigMap", "Secret")


@dataclasses.dataclass(frozen=True)
class LiveChildren:
    """Children owned by one DisaggReplicaSet, by kind then name."""

    by_kind: dict[str, dict[str, Manifest]]

    def of(self, kind: str) -> dict[str, Manifest]:
        return self.by_kind.get(kind, {})


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Nodes and the (non-finished) pods bound to them, cluster-wide."""

    nodes: list[Manifest]
    pods: list[Manifest]


async def read_drs(api: client.ApiClient, namespace: str, name: str) -> Manifest | None:
    custom = client.CustomObjectsApi(api)
    try:
        return await as_json(
            custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S
            )
        )
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _owned_by(obj: Manifest, uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


async def read_children(api: client.ApiClient, namespace: str, name: str, uid: str) -> LiveChildren:
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    selector = f"{LABEL_REPLICASET}={name}"
    kw: dict[str, Any] = {"label_selector": selector, "_preload_content": False, "_request_timeout": REQUEST_TIMEOUT_S}
    lists = {
        "Pod": core.list_namespaced_pod(namespace, **kw),
        "Deployment": apps.list_namespaced_deployment(namespace, **kw),
        "Service": core.list_namespaced_service(namespace, **kw),
        "ConfigMap": core.list_namespaced_config_map(namespace, **kw),
        "Secret": core.list_namespaced_secret(namespace, **kw),
    }
    by_kind: dict[str, dict[str, Manifest]] = {}
    for kind, call in lists.items():
        items = (await as_json(call)).get("items") or []
        by_kind[kind] = {i["metadata"]["name"]: {**i, "kind": kind} for i in items if _owned_by(i, uid)}
    return LiveChildren(by_kind)


async def read_cluster(api: client.ApiClient) -> Cluster:
    core = client.CoreV1Api(api)
    nodes = await as_json(core.list_node(_preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))
    pods = await as_json(
        core.list_pod_for_all_namespaces(
            field_selector="spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed",
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT_S,
        )
    )
    return Cluster(nodes=nodes.get("items") or [], pods=pods.get("items") or [])
