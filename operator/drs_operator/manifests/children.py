"""``desired_children``: every object a placed plan needs, grouped the way the reconcile applies them.

Only placed replicas get children (gang semantics: a replica that could not be placed whole
creates nothing). ConfigMaps and Services come first, engine pods next, frontends last: a
frontend is useless before its engines exist, and engines read their ConfigMap at start. A
replica's NetworkPolicy (``spec.networkPolicy.enabled``) goes with the configs, before its pods.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from drs_protocol.weights_state import DesiredWeights

from drs_operator.api.constants import ROLES
from drs_operator.api.objects import Manifest
from drs_operator.api.spec import DisaggReplicaSetSpec
from drs_operator.manifests.common import SPEC_HASH_ANNOTATION, Owner
from drs_operator.manifests.engines import (
    build_engine_configmap,
    build_engine_pods,
    build_engines_service,
    build_weights_configmap,
)
from drs_operator.manifests.frontends import (
    build_frontend_config,
    build_frontend_configmap,
    build_frontend_deployment,
    build_frontend_service,
    engine_pool,
    frontend_config_hash,
    frontend_processes,
)
from drs_operator.manifests.policies import OperatorPods, build_replica_network_policy
from drs_operator.placement import Placement
from drs_operator.plan import Plan


@dataclasses.dataclass(frozen=True)
class ReplicaChildren:
    index: int
    engine_pods: tuple[Manifest, ...]
    frontend_config: Manifest
    frontend_deployments: tuple[Manifest, ...]  #: per frontend: process 0, then its standby (spec.frontend.standby)
    frontend_services: tuple[Manifest, ...]
    network_policy: Manifest | None = None  #: its engines' NetworkPolicy (spec.networkPolicy.enabled)


@dataclasses.dataclass(frozen=True)
class Children:
    """Desired children of one DisaggReplicaSet, keyed by kind then name where it matters."""

    configmaps: tuple[Manifest, ...]  #: per-role engine configs (per-replica frontend configs live in replicas)
    services: tuple[Manifest, ...]  #: the headless engines Service (pod networking)
    replicas: tuple[ReplicaChildren, ...]  #: placed replicas only

    def all_of(self, kind: str) -> dict[str, Manifest]:
        """Every desired object of ``kind`` by name (a copy of the mapping; built once per
        instance, since status and roll-out ask for it once per engine of a large fleet)."""
        return dict(self._by_kind.get(kind, {}))

    @functools.cached_property
    def _by_kind(self) -> dict[str, dict[str, Manifest]]:
        out: dict[str, dict[str, Manifest]] = {}
        items: list[Manifest] = [*self.configmaps, *self.services]
        for r in self.replicas:
            items += [*r.engine_pods, r.frontend_config, *r.frontend_deployments, *r.frontend_services]
            items += [r.network_policy] if r.network_policy is not None else []
        for m in items:
            out.setdefault(m["kind"], {})[m["metadata"]["name"]] = m
        return out


def hash_of(manifest: Mapping[str, Any]) -> str | None:
    annotations: Mapping[str, str] = (manifest.get("metadata") or {}).get("annotations") or {}
    return annotations.get(SPEC_HASH_ANNOTATION)


def desired_children(
    owner: Owner,
    spec: DisaggReplicaSetSpec,
    plan: Plan,
    placement: Placement,
    addresses: Mapping[str, str],
    desired_weights: DesiredWeights | None = None,
    operator: OperatorPods | None = None,
) -> Children:
    role_configs = {role: build_engine_configmap(owner, spec, plan, role) for role in ROLES}
    services = () if plan.host_network else (build_engines_service(owner, spec.trtllm.engine_port),)
    replicas: list[ReplicaChildren] = []
    pools = {
        (rp.index, role): engine_pool(plan, rp, placement.replica(rp.index), role, owner.namespace, addresses)
        for rp in plan.replicas
        if placement.replica(rp.index).placed
        for role in ROLES
    }
    peers = [url for urls in pools.values() for url in urls]  # where a path-less catch-up asks
    weights_config = build_weights_configmap(owner, desired_weights, peers)
    for rp in plan.replicas:
        placed = placement.replica(rp.index)
        if not placed.placed:
            continue
        fallback = {
            role: [url for (r, rl), urls in pools.items() if rl == role and r != rp.index for url in urls]
            for role in ROLES
        }
        by_name = {e.name: e for e in placed.engines}
        pods: list[Manifest] = []
        for slot in rp.engines:
            config_hash = hash_of(role_configs[slot.role]) or ""
            pods += build_engine_pods(owner, spec, plan, slot, by_name[slot.name], addresses, config_hash)
        config = build_frontend_config(spec, plan, rp, placed, owner.namespace, addresses, fallback)
        fe_config = build_frontend_configmap(owner, rp.index, config)
        fe_nodes = {f.index: f.node for f in placed.frontends}
        config_hash = frontend_config_hash(config)
        deployments = tuple(
            build_frontend_deployment(owner, spec, plan, f, fe_nodes[f.index] or "", config_hash, process)
            for f in rp.frontends
            for process in frontend_processes(spec)
        )
        fe_services = tuple(build_frontend_service(owner, f, spec.frontend_standby) for f in rp.frontends)
        policy = build_replica_network_policy(owner, spec, rp.index, operator) if spec.network_policy.enabled else None
        replicas.append(ReplicaChildren(rp.index, tuple(pods), fe_config, deployments, fe_services, policy))
    return Children(configmaps=(*role_configs.values(), weights_config), services=services, replicas=tuple(replicas))
