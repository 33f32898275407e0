"""Engine pods, their per-role ConfigMaps and the headless Service (the token Secrets: :mod:`.secrets`).

One pod per engine, named after the engine; an engine wider than a node is a gang of pods, one
per node, rank 0 named after the engine (the leader: Ray head and engine server) and rank k named
``<engine>-w<k>`` (joins the leader's Ray cluster), each with the variables of
``drs_protocol.gang``: ``DRS_RANK``, ``DRS_WORLD_SIZE``, ``DRS_LEADER_ADDRESS`` (the leader pod's DNS
name under the headless Service, or its node's address with host networking), ``DRS_RANK_GPUS``
and, for a gang, ``DRS_RAY_PORT``. Every pod:

* is pinned to its placed node by required node affinity (``matchFields metadata.name``) and asks
  for exactly its GPUs (``nvidia.com/gpu``);
* reads its role's rendered engine configuration (merged TensorRT-LLM kwargs, model, cache
  transceiver) from the role's ConfigMap through ``DRS_ENGINE_CONFIG_JSON``, the control-API
  token and the serving token from their Secrets through ``DRS_CONTROL_TOKEN`` and
  ``DRS_SERVING_TOKEN`` (``drs_protocol.auth``), and the fleet's desired weights from the
  weights ConfigMap through ``DRS_DESIRED_WEIGHTS_JSON`` and the engines to catch up from when they
  have no path through ``DRS_WEIGHTS_PEERS_JSON`` (both optional; a new value rolls nothing: only
  the reference is in the pod, and the engine reads the value once, at its start), and the same
  ConfigMap mounted at ``/etc/drs/weights`` (``DRS_WEIGHTS_DIR``; optional), whose ``peers`` file
  a catching-up engine reads again on every attempt (the kubelet updates it: peers placed later);
* drains when stopped: the engine turns SIGTERM into a drain of ``spec.engine.drainSeconds`` (503 to
  probes and new legs, legs in flight finish) and ``terminationGracePeriodSeconds`` is that plus a
  margin; no preStop hook is needed because the engine itself flips its readiness first;
* has a readiness probe on ``/health``, a memory-backed ``/dev/shm`` (NCCL), the model volume when
  the spec names one, and the user's pod-template overlays (``spec.template`` then the role's);
* has a stable address: hostname + subdomain under the headless Service (pod networking), or the
  node's address and the plan's per-engine port (host networking).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from drs_protocol import env, gang, routes
from drs_protocol.config import render
from drs_protocol.engine_config import CacheTransceiverSpec, EngineConfig, ModelSpec
from drs_protocol.lifecycle import TERMINATION_MARGIN_SECONDS
from drs_protocol.limits import DEFAULT_MAX_MODEL_LEN, FRONTEND_MAX_REQUEST_BYTES, engine_max_request_bytes
from drs_protocol.weights_state import DesiredWeights
from drs_protocol.weights_stream import MAX_WEIGHTS_PEERS, WEIGHTS_MOUNT_PATH, WeightsPeers

from drs_operator.api import names
from drs_operator.api.constants import GPU_RESOURCE, LABEL_ORDINAL, LABEL_RANK, LABEL_REPLICASET, Role
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
    with_hash,
)
from drs_operator.manifests.secrets import control_token_mount, serving_token_mount
from drs_operator.placement import EnginePlacement
from drs_operator.plan import EngineSlot, Plan

ENGINE_CONTAINER: Final = "engine"
SHM_VOLUME: Final = "dshm"
#: The fleet's weights ConfigMap, mounted (optional) at ``drs_protocol.weights_stream.WEIGHTS_MOUNT_PATH``.
WEIGHTS_VOLUME: Final = "weights"
MODEL_VOLUME: Final = "model"
#: Engines probe often: a draining engine (503) should leave the Service and the status within a second or two.
READINESS_PERIOD_S: Final = 1


def build_engine_config(spec: DisaggReplicaSetSpec, plan: Plan, role: Role) -> EngineConfig:
    """The engine configuration of ``role``: the model ``drs engine`` parses, validated here, with
    only the fields the spec sets (the engine's defaults stand for the rest)."""
    block = spec.role(role)
    kwargs = dict(plan.role(role).trtllm_kwargs)
    transceiver = kwargs.pop("cache_transceiver_config", None)
    model: dict[str, Any] = {"path": spec.model.path, "precision": str(spec.model.precision)}
    for name in ("tokenizer", "max_model_len", "served_name"):
        if getattr(spec.model, name):
            model[name] = getattr(spec.model, name)
    fields: dict[str, Any] = {
        "role": role,
        "backend": spec.engine.backend,
        "model": ModelSpec.model_validate(model),
        "tensor_parallel_size": block.tensor_parallel_size,
        "trtllm_kwargs": kwargs,
    }
    for name in _ROLE_KNOBS:
        if getattr(block, name) is not None:
            fields[name] = getattr(block, name)
    if isinstance(transceiver, Mapping):
        fields["cache_transceiver"] = CacheTransceiverSpec.model_validate(dict(transceiver))
    sim = spec.engine.sim_settings()
    if sim is not None:
        fields["sim"] = sim
    if spec.engine.torch is not None:
        fields["torch"] = spec.engine.torch
    fields["drain_seconds"] = spec.engine.drain_seconds
    fields["max_request_bytes"] = engine_request_bytes(spec)
    return EngineConfig.model_validate(fields)


def engine_request_bytes(spec: DisaggReplicaSetSpec) -> int:
    """The engines' body limit: what a frontend at its limit forwards for the spec's maxModelLen
    (:func:`drs_protocol.limits.engine_max_request_bytes`); the frontends render the same number."""
    return engine_max_request_bytes(FRONTEND_MAX_REQUEST_BYTES, spec.model.max_model_len or DEFAULT_MAX_MODEL_LEN)


#: RoleSpec fields copied into the engine config when set.
_ROLE_KNOBS: Final = (
    "moe_tensor_parallel_size",
    "moe_expert_parallel_size",
    "gpu_memory_utilization",
    "max_batch_size",
    "max_num_tokens",
)


def build_engine_configmap(owner: Owner, spec: DisaggReplicaSetSpec, plan: Plan, role: Role) -> Manifest:
    config = build_engine_config(spec, plan, role)
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": owner.metadata(names.engine_config_name(owner.name, role), names.labels(owner.name, str(role))),
            "data": {CONFIG_KEY: render(config)},
        }
    )


def build_weights_configmap(owner: Owner, desired: DesiredWeights | None, peers: Sequence[str] = ()) -> Manifest:
    """The fleet's desired weights (``disagg.dev/desired-weights``, as the sidecar stored them;
    empty: none), for the engine pods' ``DRS_DESIRED_WEIGHTS_JSON``, and, when they have no
    checkpoint path, the fleet's engines to catch up from (``peers``, for ``DRS_WEIGHTS_PEERS_JSON``:
    every placed engine's URL; an engine that does not hold them is skipped by the one asking).
    Replaced when they change; no pod's hash depends on it."""
    data = {env.DESIRED_WEIGHTS_KEY: desired.dump() if desired else ""}
    if desired is not None and desired.path is None and peers:
        data[env.WEIGHTS_PEERS_KEY] = WeightsPeers(tuple(peers[:MAX_WEIGHTS_PEERS])).dump()
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": owner.metadata(names.weights_config_name(owner.name), names.labels(owner.name)),
            "data": data,
        }
    )


def build_engines_service(owner: Owner, port: int) -> Manifest:
    """The headless Service that gives every engine pod a DNS name (pod networking)."""
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": owner.metadata(names.engines_service_name(owner.name), names.labels(owner.name)),
            "spec": {
                "clusterIP": "None",
                "selector": {LABEL_REPLICASET: owner.name, LABEL_RANK: "0"},
                "publishNotReadyAddresses": True,
                "ports": [{"name": "http", "port": port, "targetPort": port}],
            },
        }
    )


def build_engine_pods(
    owner: Owner,
    spec: DisaggReplicaSetSpec,
    plan: Plan,
    slot: EngineSlot,
    placed: EnginePlacement,
    addresses: Mapping[str, str],
    config_hash: str,
) -> list[Manifest]:
    """The pods of one placed engine (one, or one per node for an engine wider than a node)."""
    world = len(placed.nodes)
    url = engine_url(plan, slot, placed.node, owner.namespace, addresses)
    leader = names.engine_host(owner.name, owner.namespace, slot.name)
    if plan.host_network and placed.node is not None and placed.node in addresses:
        leader = addresses[placed.node]
    pods = []
    for rank, node in enumerate(placed.nodes):
        gpus = slot.width // world
        pods.append(_engine_pod(owner, spec, plan, slot, node, rank, world, gpus, url or "", leader, config_hash))
    return pods


def _engine_pod(
    owner: Owner,
    spec: DisaggReplicaSetSpec,
    plan: Plan,
    slot: EngineSlot,
    node: str,
    rank: int,
    world: int,
    gpus: int,
    url: str,
    leader: str,
    config_hash: str,
) -> Manifest:
    name = names.engine_pod_name(owner.name, slot.replica, slot.role, slot.ordinal, rank)
    labels = {
        **names.labels(owner.name, str(slot.role), slot.replica),
        LABEL_ORDINAL: str(slot.ordinal),
        LABEL_RANK: str(rank),
    }
    volumes, mounts = _engine_volumes(owner, spec)
    pod_env = _engine_env(owner, plan, slot, rank, world, gpus, leader)
    container = _engine_container(spec, slot, gpus, url, pod_env, mounts)
    pod_spec: dict[str, Any] = {
        "securityContext": restricted_pod_security(),
        "affinity": node_affinity(node),
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": spec.engine.drain_seconds + TERMINATION_MARGIN_SECONDS,
        "containers": [container],
        "volumes": volumes,
    }
    if plan.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    else:
        pod_spec["hostname"] = name
        pod_spec["subdomain"] = names.engines_service_name(owner.name)
    if spec.topology.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.topology.tolerations]
    annotations = {NODE_ANNOTATION: node, CONFIG_HASH_ANNOTATION: config_hash}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": owner.metadata(name, labels, annotations), "spec": pod_spec}
    pod = overlay_pod_template(pod, spec.template, spec.role(slot.role).template)
    return with_hash(pod)


def _engine_env(
    owner: Owner, plan: Plan, slot: EngineSlot, rank: int, world: int, gpus: int, leader: str
) -> list[dict[str, Any]]:
    """The pod's address and name, its role's config, the control and serving tokens and the gang variables
    (``drs_protocol.gang``; the Ray port only for an engine wider than a node)."""
    pod_env: list[dict[str, Any]] = [
        field_env(env.POD_IP, "status.podIP"),
        field_env(env.POD_NAME, "metadata.name"),
        {
            "name": env.ENGINE_CONFIG_JSON,
            "valueFrom": {
                "configMapKeyRef": {"name": names.engine_config_name(owner.name, slot.role), "key": CONFIG_KEY}
            },
        },
        control_token_mount(owner.name).env,
        serving_token_mount(owner.name).env,
        {
            "name": env.DESIRED_WEIGHTS_JSON,
            "valueFrom": {
                "configMapKeyRef": {
                    "name": names.weights_config_name(owner.name),
                    "key": env.DESIRED_WEIGHTS_KEY,
                    "optional": True,
                }
            },
        },
        {
            "name": env.WEIGHTS_PEERS_JSON,
            "valueFrom": {
                "configMapKeyRef": {
                    "name": names.weights_config_name(owner.name),
                    "key": env.WEIGHTS_PEERS_KEY,
                    "optional": True,
                }
            },
        },
        {"name": env.WEIGHTS_DIR, "value": WEIGHTS_MOUNT_PATH},
        {"name": env.RANK, "value": str(rank)},
        {"name": env.WORLD_SIZE, "value": str(world)},
        {"name": env.LEADER_ADDRESS, "value": leader},
        {"name": env.RANK_GPUS, "value": str(gpus)},
    ]
    if world > 1:
        pod_env.append({"name": env.RAY_PORT, "value": str(gang.ray_port_for(slot.port, plan.host_network))})
    return pod_env


def _engine_volumes(owner: Owner, spec: DisaggReplicaSetSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(volumes, mounts)``: a memory-backed ``/dev/shm`` (NCCL), the two token Secrets (re-read
    while the engine runs: rotation), the fleet's weights ConfigMap (its peers re-read on every
    catch-up attempt) and the model volume if named."""
    scratch_volume, scratch_mount = scratch()
    tokens = (control_token_mount(owner.name), serving_token_mount(owner.name))
    mounts: list[dict[str, Any]] = [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}, scratch_mount]
    volumes: list[dict[str, Any]] = [{"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}, scratch_volume]
    mounts += [t.mount for t in tokens]
    volumes += [t.volume for t in tokens]
    mounts.append({"name": WEIGHTS_VOLUME, "mountPath": WEIGHTS_MOUNT_PATH, "readOnly": True})
    volumes.append(
        {"name": WEIGHTS_VOLUME, "configMap": {"name": names.weights_config_name(owner.name), "optional": True}}
    )
    if spec.model.volume:
        volumes.append({"name": MODEL_VOLUME, **dict(spec.model.volume)})
        mounts.append({"name": MODEL_VOLUME, "mountPath": spec.model.mount_path, "readOnly": True})
    return volumes, mounts


def _engine_container(
    spec: DisaggReplicaSetSpec,
    slot: EngineSlot,
    gpus: int,
    url: str,
    pod_env: list[dict[str, Any]],
    mounts: list[dict[str, Any]],
) -> dict[str, Any]:
    """``drs engine`` with its backend, role, address and port; exactly its GPUs; ready on ``/health``."""
    args = ["--backend", str(spec.engine.backend), "--role", str(slot.role), "--host", f"$({env.POD_IP})"]
    args += ["--port", str(slot.port)]
    if url:
        args += ["--advertise-url", url]
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": spec.images.engine,
        "command": ["drs", "engine"],
        "args": args,
        "env": pod_env,
        "ports": [{"name": "http", "containerPort": slot.port}],
        "resources": {"limits": {GPU_RESOURCE: str(gpus)}, "requests": {GPU_RESOURCE: str(gpus)}},
        "readinessProbe": {
            "httpGet": {"path": routes.HEALTH, "port": slot.port},
            "periodSeconds": READINESS_PERIOD_S,
            "failureThreshold": 3,
        },
        "volumeMounts": mounts,
        "securityContext": restricted_container_security(),
    }
    if spec.images.pull_policy:
        container["imagePullPolicy"] = spec.images.pull_policy
    return container
