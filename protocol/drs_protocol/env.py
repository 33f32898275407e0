"""Environment variables one process sets (or renders into a pod) and another reads.

The operator renders the engine and frontend pods' environment from these names; ``drs engine``,
``drs frontend`` and ``drs sidecar`` read the same names; the dev cluster's pod runner sets
:data:`NODE_IP` the way a kubelet would expose the node address.
"""

from __future__ import annotations

from typing import Final

#: The engine control API's bearer token (operator: from the control Secret; engine and sidecar read it).
CONTROL_TOKEN: Final = "DRS_CONTROL_TOKEN"
#: The engines' serving token (operator: from the serving Secret; engines, frontends and whoever
#: calls an engine's serving routes read it; ``drs_protocol.auth``).
SERVING_TOKEN: Final = "DRS_SERVING_TOKEN"
#: The directories the two token Secrets are mounted at (``drs_protocol.token_source``): when set,
#: they win over the variables above and are re-read while the process runs (rotation).
CONTROL_TOKEN_DIR: Final = "DRS_CONTROL_TOKEN_DIR"
SERVING_TOKEN_DIR: Final = "DRS_SERVING_TOKEN_DIR"
#: The engine config as JSON (:class:`drs_protocol.engine_config.EngineConfig`), from the role's ConfigMap.
ENGINE_CONFIG_JSON: Final = "DRS_ENGINE_CONFIG_JSON"
#: The frontend config as JSON (:class:`drs_protocol.frontend_config.FrontendConfig`), from the replica's ConfigMap.
FRONTEND_CONFIG_JSON: Final = "DRS_FRONTEND_CONFIG_JSON"
#: The fleet's desired weights as JSON (:class:`drs_protocol.weights_state.DesiredWeights`; empty:
#: none), from the fleet's weights ConfigMap (read once, at the engine's start).
DESIRED_WEIGHTS_JSON: Final = "DRS_DESIRED_WEIGHTS_JSON"
#: The engines holding the fleet's desired weights, as JSON (:class:`drs_protocol.weights_stream.WeightsPeers`;
#: empty: none), from the fleet's weights ConfigMap: where an engine catches up when the desired
#: weights have no path (read once, at the engine's start).
WEIGHTS_PEERS_JSON: Final = "DRS_WEIGHTS_PEERS_JSON"
#: The directory where the fleet's weights ConfigMap is mounted (each key a file:
#: :data:`DESIRED_WEIGHTS_KEY`, :data:`WEIGHTS_PEERS_KEY`; the operator mounts it at
#: :data:`drs_protocol.weights_stream.WEIGHTS_MOUNT_PATH`): an engine catching up from peers reads
#: the peers' file again on every attempt (the kubelet updates it), :data:`WEIGHTS_PEERS_JSON` when
#: the file is not there.
WEIGHTS_DIR: Final = "DRS_WEIGHTS_DIR"
#: Where a ``trtllm`` engine keeps the bytes of its last collective update or peer load, so it can
#: stream them to a peer catching up (TensorRT-LLM's own parameters are fused and re-laid out: they
#: are not the trainer's layout). Unset: ``<TMPDIR>/drs-weights`` (engine pods: the scratch emptyDir,
#: which a pod-template overlay may point at a larger local disk).
WEIGHTS_RETAIN_DIR: Final = "DRS_WEIGHTS_RETAIN_DIR"
#: The pod's own address (downward API ``status.podIP``); the pods' ``--host $(POD_IP)``.
POD_IP: Final = "POD_IP"
#: The pod's name (downward API ``metadata.name``).
POD_NAME: Final = "POD_NAME"
#: The pod's namespace (downward API ``metadata.namespace``; the chart sets it for the operator's Lease).
POD_NAMESPACE: Final = "POD_NAMESPACE"
#: The labels that select the operator's own pods, as ``key=value,key=value`` (the chart sets its
#: selector labels): with :data:`POD_NAMESPACE`, the peer every per-replica NetworkPolicy admits to
#: the engines, since the operator asks each engine which weights it holds.
OPERATOR_POD_LABELS: Final = "DRS_OPERATOR_POD_LABELS"
#: The node's address, set by the dev cluster's pod runner (plays the kubelet's part).
NODE_IP: Final = "DRS_NODE_IP"
#: A multi-node engine's pods: this pod's rank (0 serves HTTP), the pod count, rank 0's address.
RANK: Final = "DRS_RANK"
WORLD_SIZE: Final = "DRS_WORLD_SIZE"
LEADER_ADDRESS: Final = "DRS_LEADER_ADDRESS"
#: GPUs of this pod's node slice (its ``nvidia.com/gpu``), declared to Ray by a multi-node engine's pods.
RANK_GPUS: Final = "DRS_RANK_GPUS"
#: The port of a multi-node engine leader's Ray head (``drs_protocol.gang.ray_port_for``).
RAY_PORT: Final = "DRS_RAY_PORT"

#: The refit sidecar's URL, for the trainer container beside it (``examples/trainer/trainer.py``
#: reads it when ``--sidecar`` is not given; ``examples/trainer/trainer-pod.yaml`` sets it).
SIDECAR_URL: Final = "DRS_SIDECAR_URL"

#: Key of the token in each of the two Secrets the operator creates (``<drs>-control``: the sidecar
#: reads it from there; ``<drs>-serving``).
TOKEN_SECRET_KEY: Final = "token"
CONTROL_TOKEN_SECRET_KEY: Final = TOKEN_SECRET_KEY
#: Key of the desired weights (JSON) in the fleet's weights ConfigMap the operator keeps.
DESIRED_WEIGHTS_KEY: Final = "desired"
#: Key of the peers holding them (JSON list of engine base URLs) in the same ConfigMap.
WEIGHTS_PEERS_KEY: Final = "peers"
