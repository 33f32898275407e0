"""Frontend Deployments, their Services and the per-replica frontend ConfigMap.

Frontend ``f`` of replica ``r`` is a Deployment of one pod (``Recreate``: never two processes
asking for the same port) pinned to its placed node, listening on ``basePort + r·F + f`` with
snowflake node id ``r·F + f``, and a Service of its own on that port. Every frontend of a replica
reads the same ConfigMap: the replica's prefill pool and decode pool URLs, the other replicas' engines
as fallback pools, and the router settings.

With ``spec.frontend.standby`` each URL has a second Deployment, ``<frontend>-standby``: the same
pod but snowflake process id 1 (label ``disagg.dev/frontend-process``), so the two processes mint
disjoint request ids under the one node id. The Service selects both (its selector leaves the
process label out) with ``ClientIP`` session affinity: a client keeps talking to one process, whose
per-conversation caches (tokenization, sticky routing) stay warm, and is moved to the other as soon
as its pod leaves the Service's endpoints (a killed pod). Routing is a pure function of the
conversation, so both processes send a conversation to the same engines.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from drs_protocol import env, routes
from drs_protocol.config import render
from drs_protocol.frontend_config import FrontendConfig
from drs_protocol.lifecycle import FALLBACK_DECODE_KEY, FALLBACK_PREFILL_KEY, FRONTEND_CONFIG_DIR
from drs_protocol.limits import FRONTEND_MAX_REQUEST_BYTES

from drs_operator.api import names
from drs_operator.api.constants import (
    LABEL_FRONTEND,
    LABEL_FRONTEND_PROCESS,
    LABEL_REPLICA,
    LABEL_REPLICASET,
    LABEL_ROLE,
    ROLE_FRONTEND,
    Role,
)
from drs_operator.api.objects import Manifest
from drs_operator.api.spec import DisaggReplicaSetSpec
from drs_operator.layout import engine_url
from drs_operator.manifests.common import (
    CONFIG_HASH_ANNOTATION,
    CONFIG_KEY,
    NODE_ANNOTATION,
    Owner,
    field_env,
    node_affinity,
    overlay_pod_template,
    restricted_container_security,
    restricted_pod_security,
    scratch,
    spec_hash,
    with_hash,
)
from drs_operator.manifests.engines import build_engine_config, engine_request_bytes
from drs_operator.manifests.secrets import serving_token_mount
from drs_operator.placement import ReplicaPlacement
from drs_operator.plan import FrontendSlot, Plan, ReplicaPlan

FRONTEND_CONTAINER: Final = "frontend"
READINESS_PERIOD_S: Final = 1
#: Seconds between a frontend's probes of its engines (an engine that comes back is used within this).
HEALTH_INTERVAL_S: Final = 1.0
LIVENESS_PERIOD_S: Final = 10
#: A frontend loads its tokenizer after it starts listening; on a busy node that took over 30 s
#: (seen on the dev cluster's real node), so liveness waits for a startup probe (up to 5 min).
STARTUP_PERIOD_S: Final = 2
STARTUP_FAILURES: Final = 150
PROBE_TIMEOUT_S: Final = 5
CONFIG_VOLUME: Final = "frontend-config"
#: ``spec.frontend.standby``: the Service keeps a client on one process for this long (Kubernetes' default).
AFFINITY_TIMEOUT_S: Final = 10800


def frontend_processes(spec: DisaggReplicaSetSpec) -> tuple[int, ...]:
    """The snowflake process ids of one frontend URL: 0, and 1 with ``spec.frontend.standby``."""
    return (0, 1) if spec.frontend_standby else (0,)


def engine_pool(
    plan: Plan, replica: ReplicaPlan, placed: ReplicaPlacement, role: Role, namespace: str, addresses: Mapping[str, str]
) -> list[str]:
    """The URLs of one placed replica's engines of ``role``."""
    nodes = {e.name: e.node for e in placed.engines}
    urls = [engine_url(plan, e, nodes.get(e.name), namespace, addresses) for e in replica.role_engines(role)]
    return [u for u in urls if u]


def build_frontend_config(
    spec: DisaggReplicaSetSpec,
    plan: Plan,
    replica: ReplicaPlan,
    placed: ReplicaPlacement,
    namespace: str,
    addresses: Mapping[str, str],
    fallback: Mapping[Role, list[str]] | None = None,
) -> FrontendConfig:
    """The :class:`~drs_protocol.frontend_config.FrontendConfig` of one replica's frontends (node
    id and port come as flags), validated here.

    ``fallback``: the other placed replicas' engines per role, used by the frontend only while none
    of its own replica's engines of that role is up (a roll, a crash). They are not part of
    :func:`frontend_config_hash`, so placing or moving another replica never restarts this one's
    frontends (a frontend started earlier simply knows fewer fallback engines)."""
    fields: dict[str, Any] = {
        "prefill": engine_pool(plan, replica, placed, Role.PREFILL, namespace, addresses),
        "decode": engine_pool(plan, replica, placed, Role.DECODE, namespace, addresses),
        "hold_seconds": spec.frontend.hold_seconds,
        "health_interval": HEALTH_INTERVAL_S,
        "ctx_router": spec.router.ctx,
        "gen_router": spec.router.gen,
        "gen_tokids_ctxbytes": spec.router.gen_tokids_ctxbytes,
        "gen_strip_message_history": spec.router.gen_strip_message_history,
        "max_sessions": spec.router.max_sessions,
        "tokenize": spec.frontend.tokenize,
        "tokenize_shadow_rate": spec.frontend.tokenize_shadow_rate,
        "token_continuity": spec.frontend.token_continuity,
        "group_routing": spec.frontend.group_routing,
        "group_hold_seconds": spec.frontend.group_hold(),
        "group_lookup_engines": spec.frontend.group_lookup_engines,
        # prefix routing hashes blocks as the prefill engines cache them (one source: their config)
        "prefix_block_tokens": build_engine_config(spec, plan, Role.PREFILL).tokens_per_block(),
        "limits": {
            "max_request_bytes": FRONTEND_MAX_REQUEST_BYTES,
            "engine_max_request_bytes": engine_request_bytes(spec),
        },
    }
    if spec.model.tokenizer:
        fields["tokenizer"] = spec.model.tokenizer
    for role, key in ((Role.PREFILL, FALLBACK_PREFILL_KEY), (Role.DECODE, FALLBACK_DECODE_KEY)):
        urls = (fallback or {}).get(role) or []
        if urls:
            fields[key] = list(urls)
    return FrontendConfig.model_validate(fields)


def frontend_config_hash(config: FrontendConfig) -> str:
    """The hash a frontend pod template carries: the rendered config without the fallback pools."""
    kept = config.model_dump(
        mode="json", by_alias=True, exclude_unset=True, exclude={FALLBACK_PREFILL_KEY, FALLBACK_DECODE_KEY}
    )
    return spec_hash({"metadata": {}, "data": kept})


def build_frontend_configmap(owner: Owner, replica: int, config: FrontendConfig) -> Manifest:
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": owner.metadata(
                names.frontend_config_name(owner.name, replica), names.labels(owner.name, ROLE_FRONTEND, replica)
            ),
            "data": {CONFIG_KEY: render(config)},
        }
    )


def _selector(owner: Owner, slot: FrontendSlot) -> dict[str, str]:
    return {
        LABEL_REPLICASET: owner.name,
        LABEL_ROLE: ROLE_FRONTEND,
        LABEL_REPLICA: str(slot.replica),
        LABEL_FRONTEND: str(slot.index),
    }


def _deployment_selector(owner: Owner, slot: FrontendSlot, process: int) -> dict[str, str]:
    """Process 0 keeps the selector (and labels) Deployments had before standbys existed (a selector
    is immutable); it cannot take the standby's pods, whose ReplicaSets carry another template hash
    and belong to the standby. The standby selects its process label too."""
    selector = _selector(owner, slot)
    return {**selector, LABEL_FRONTEND_PROCESS: str(process)} if process else selector


def _frontend_container(
    owner: Owner, spec: DisaggReplicaSetSpec, slot: FrontendSlot, process: int, scratch_mount: dict[str, Any]
) -> dict[str, Any]:
    """The frontend container of process ``process`` of ``slot``: its flags, config, probes, mounts."""
    container: dict[str, Any] = {
        "name": FRONTEND_CONTAINER,
        "image": spec.images.frontend,
        "command": ["drs", "frontend"],
        "args": [
            "--host",
            f"$({env.POD_IP})",
            "--port",
            str(slot.port),
            "--node-id",
            str(slot.node_id),
            *(["--process-id", str(process)] if process else []),
            "--config-watch",
            f"{FRONTEND_CONFIG_DIR}/{CONFIG_KEY}",
        ],
        "env": [
            field_env(env.POD_IP, "status.podIP"),
            {
                "name": env.FRONTEND_CONFIG_JSON,
                "valueFrom": {
                    "configMapKeyRef": {"name": names.frontend_config_name(owner.name, slot.replica), "key": CONFIG_KEY}
                },
            },
            serving_token_mount(owner.name).env,
        ],
        "ports": [{"name": "http", "containerPort": slot.port}],
        "readinessProbe": {"httpGet": {"path": routes.READY, "port": slot.port}, "periodSeconds": READINESS_PERIOD_S},
        "startupProbe": {
            "httpGet": {"path": routes.HEALTH, "port": slot.port},
            "periodSeconds": STARTUP_PERIOD_S,
            "failureThreshold": STARTUP_FAILURES,
            "timeoutSeconds": PROBE_TIMEOUT_S,
        },
        "livenessProbe": {
            "httpGet": {"path": routes.HEALTH, "port": slot.port},
            "periodSeconds": LIVENESS_PERIOD_S,
            "failureThreshold": 3,
            "timeoutSeconds": PROBE_TIMEOUT_S,
        },
        "volumeMounts": [
            scratch_mount,
            {"name": CONFIG_VOLUME, "mountPath": FRONTEND_CONFIG_DIR, "readOnly": True},
            serving_token_mount(owner.name).mount,
        ],
        "securityContext": restricted_container_security(),
    }
    if spec.frontend.resources:
        container["resources"] = dict(spec.frontend.resources)
    if spec.images.pull_policy:
        container["imagePullPolicy"] = spec.images.pull_policy
    return container


def build_frontend_deployment(
    owner: Owner,
    spec: DisaggReplicaSetSpec,
    plan: Plan,
    slot: FrontendSlot,
    node: str,
    config_hash: str,
    process: int = 0,
) -> Manifest:
    """The Deployment of process ``process`` (0, or 1 for the standby) of frontend ``slot``."""
    labels = {**names.labels(owner.name, ROLE_FRONTEND, slot.replica), LABEL_FRONTEND: str(slot.index)}
    if process:  # process 0 carries no process label: its manifest (and hash) is what it was before standbys
        labels[LABEL_FRONTEND_PROCESS] = str(process)
    name = names.frontend_deployment_name(owner.name, slot.replica, slot.index, process)
    scratch_volume, scratch_mount = scratch()
    container = _frontend_container(owner, spec, slot, process, scratch_mount)
    pod_spec: dict[str, Any] = {
        "securityContext": restricted_pod_security(),
        "affinity": node_affinity(node),
        "containers": [container],
        "volumes": [
            scratch_volume,
            # the same config again as a file the kubelet updates in place: new fallback pools reach
            # the running frontend (drs_frontend.reload) without a restart
            {"name": CONFIG_VOLUME, "configMap": {"name": names.frontend_config_name(owner.name, slot.replica)}},
            # the serving token as files the frontend re-reads (rotation without a restart)
            serving_token_mount(owner.name).volume,
        ],
    }
    if plan.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    if spec.topology.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.topology.tolerations]
    template = {
        "metadata": {
            "name": name,
            "namespace": owner.namespace,
            "labels": labels,
            "annotations": {NODE_ANNOTATION: node, CONFIG_HASH_ANNOTATION: config_hash},
        },
        "spec": pod_spec,
    }
    template = overlay_pod_template(template, spec.frontend.template)
    template["metadata"].pop("name", None)
    template["metadata"].pop("namespace", None)
    template["metadata"].pop("ownerReferences", None)
    return with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": owner.metadata(name, labels, {NODE_ANNOTATION: node}),
            "spec": {
                "replicas": 1,
                "strategy": {"type": "Recreate"},
                "selector": {"matchLabels": _deployment_selector(owner, slot, process)},
                "template": template,
            },
        }
    )


def build_frontend_service(owner: Owner, slot: FrontendSlot, standby: bool = False) -> Manifest:
    """The frontend's Service: every process of the URL (the selector leaves the process label out);
    with a standby, ``ClientIP`` affinity keeps a client on one of them while it is an endpoint."""
    labels = {**names.labels(owner.name, ROLE_FRONTEND, slot.replica), LABEL_FRONTEND: str(slot.index)}
    spec: dict[str, Any] = {
        "selector": _selector(owner, slot),
        "ports": [{"name": "http", "port": slot.port, "targetPort": slot.port}],
    }
    if standby:
        spec["sessionAffinity"] = "ClientIP"
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": AFFINITY_TIMEOUT_S}}
    return with_hash(
        {"apiVersion": "v1", "kind": "Service", "metadata": owner.metadata(slot.name, labels), "spec": spec}
    )
