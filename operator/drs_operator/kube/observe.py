"""Read what exists: the DisaggReplicaSet (fresh from the apiserver), and the shapes of what the
watch caches serve (``kube/cache.py``).

The resource itself is read fresh at the start of every reconcile (a GET): its status is the
operator's memory, and a stale one would place replicas from an older placement. Children,
nodes and the GPUs other pods hold come from the watch caches. Children are found by the
``disagg.dev/replicaset`` label and kept only if their controller ownerReference is this
resource's UID, so objects of a deleted namesake waiting for garbage collection are never adopted.
"""

from __future__ import annotations

import dataclasses

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from drs_operator.api.constants import GROUP, PLURAL, VERSION
from drs_operator.api.objects import Manifest
from drs_operator.kube.client import REQUEST_TIMEOUT_S, as_json


@dataclasses.dataclass(frozen=True)
class LiveChildren:
    """Children owned by one DisaggReplicaSet, by kind then name."""

    by_kind: dict[str, dict[str, Manifest]]

    def of(self, kind: str) -> dict[str, Manifest]:
        return self.by_kind.get(kind, {})


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


def owned_by(obj: Manifest, uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)
