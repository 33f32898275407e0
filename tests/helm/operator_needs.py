"""Every request the operator makes to the apiserver, as RBAC (verb, group, resource) rows, each with
the code that makes it. The chart's RBAC (helm/drs-operator/templates/rbac.yaml) must grant
exactly these: ``test_chart_render`` compares the rendered rules with this table both ways, and
``test_chart_on_cluster`` asks the real apiserver (``kubectl auth can-i`` as the ServiceAccount)
about every row.

Where a row applies:

* ``cluster``: cluster-scoped resources, and namespaced ones read in every namespace at once;
* ``workloads``: in each namespace whose DisaggReplicaSets the operator serves;
* ``lease``: in the release namespace, on the leader Lease only when ``name`` is set.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from drs_operator.api.constants import GROUP, PLURAL
from drs_operator.leader import LEASE_NAME

Scope = Literal["cluster", "workloads", "lease"]


@dataclasses.dataclass(frozen=True)
class Need:
    verb: str
    group: str  # "" is the core group
    resource: str  # "<plural>" or "<plural>/<subresource>"
    scope: Scope
    why: str  # the code (under operator/drs_operator, or kopf's) that makes the request
    name: str | None = None

    @property
    def id(self) -> str:
        plural, _, subresource = self.resource.partition("/")
        target = f"{plural}.{self.group}" if self.group else plural
        target += f"/{subresource}" if subresource else ""
        target += f" named {self.name}" if self.name else ""
        return f"{self.verb} {target} ({self.scope}) for {self.why}"


def _rows(verbs: str, group: str, resource: str, scope: Scope, why: str, name: str | None = None) -> list[Need]:
    return [Need(verb, group, resource, scope, why, name) for verb in verbs.split()]


NEEDS: tuple[Need, ...] = (
    # --- cluster-wide reads ---------------------------------------------------------------------
    *_rows("list watch", "", "nodes", "cluster", "kube/cache.py ClusterCache.nodes (list_node)"),
    *_rows("list watch", "", "pods", "cluster", "kube/cache.py ClusterCache.gpu_pods (list_pod_for_all_namespaces)"),
    *_rows(
        "list watch",
        "",
        "namespaces",
        "cluster",
        "kopf namespace_observer (kopf/_core/reactor/observation.py) with --namespace",
    ),
    *_rows(
        "list watch",
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        "cluster",
        "kopf resource_observer (kopf/_core/reactor/observation.py)",
    ),
    # --- where DisaggReplicaSets live -----------------------------------------------------------
    *_rows("list watch", GROUP, PLURAL, "workloads", "handlers.py on_disaggreplicaset"),
    *_rows("get", GROUP, PLURAL, "workloads", "kube/observe.py read_drs"),
    *_rows("patch", GROUP, PLURAL, "workloads", "kopf removing a kopf finalizer (kopf/_core/reactor/processing.py)"),
    *_rows("patch", GROUP, f"{PLURAL}/status", "workloads", "kube/apply.py Applier.patch_status"),
    *_rows(
        "update",
        GROUP,
        f"{PLURAL}/finalizers",
        "workloads",
        "blockOwnerDeletion in manifests/common.py Owner.reference",
    ),
    *_rows("create update delete", "", "pods", "workloads", "kube/apply.py Applier"),
    *_rows("patch", "", "pods", "workloads", "kube/apply.py Applier.annotate_pod (weights_touch.py)"),
    *_rows("create update delete", "", "services", "workloads", "kube/apply.py Applier"),
    *_rows("create update delete", "", "configmaps", "workloads", "kube/apply.py Applier"),
    *_rows("create update delete", "", "secrets", "workloads", "kube/apply.py Applier"),
    *_rows("create update delete", "apps", "deployments", "workloads", "kube/apply.py Applier"),
    *_rows("create update delete", "networking.k8s.io", "networkpolicies", "workloads", "kube/apply.py Applier"),
    *_rows("list watch", "", "pods", "workloads", "kube/cache.py ClusterCache.children"),
    *_rows("list watch", "", "services", "workloads", "kube/cache.py ClusterCache.children"),
    *_rows("list watch", "", "configmaps", "workloads", "kube/cache.py ClusterCache.children"),
    *_rows("list watch", "", "secrets", "workloads", "kube/cache.py ClusterCache.children"),
    *_rows("list watch", "apps", "deployments", "workloads", "kube/cache.py ClusterCache.children"),
    *_rows("list watch", "networking.k8s.io", "networkpolicies", "workloads", "kube/cache.py ClusterCache.children"),
    *_rows("create", "", "events", "workloads", "kube/apply.py Applier.event and kopf's event posting"),
    # --- the leader Lease -----------------------------------------------------------------------
    *_rows("create", "coordination.k8s.io", "leases", "lease", "leader.py create_namespaced_lease"),
    *_rows(
        "get update",
        "coordination.k8s.io",
        "leases",
        "lease",
        "leader.py read_namespaced_lease, replace_namespaced_lease",
        LEASE_NAME,
    ),
)
