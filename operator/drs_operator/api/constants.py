"""Named constants of the DisaggReplicaSet API: identity, label keys, conditions, phases, defaults.

Every string that another component matches on (a label key, a condition type or reason, a role
name) is defined here once.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Final

from drs_protocol import engine_config, frontend_config
from drs_protocol.enums import ROLES, CtxRouter, EngineBackend, GenRouter, Precision, Role
from drs_protocol.snowflake import NODE_IDS

__all__ = ["ROLES", "CtxRouter", "EngineBackend", "GenRouter", "Precision", "Role"]  # defined in drs_protocol.enums

# --- identity of the resource ---------------------------------------------------------------
GROUP: Final = "disagg.dev"
VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{GROUP}/{VERSION}"
KIND: Final = "DisaggReplicaSet"
LIST_KIND: Final = "DisaggReplicaSetList"
PLURAL: Final = "disaggreplicasets"
SINGULAR: Final = "disaggreplicaset"
SHORT_NAMES: Final = ("drs",)
CATEGORIES: Final = ("disagg",)
CRD_NAME: Final = f"{PLURAL}.{GROUP}"

# --- labels every child carries -------------------------------------------------------------
LABEL_NAME: Final = "app.kubernetes.io/name"
LABEL_INSTANCE: Final = "app.kubernetes.io/instance"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_PART_OF: Final = "app.kubernetes.io/part-of"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
#: Value of ``app.kubernetes.io/name`` and ``app.kubernetes.io/part-of`` on every child.
APP_NAME: Final = "disaggreplicaset"
#: Value of ``app.kubernetes.io/managed-by`` on every child.
MANAGER_NAME: Final = "drs-operator"
#: The owning DisaggReplicaSet's name.
LABEL_REPLICASET: Final = f"{GROUP}/replicaset"
#: The replica index (decimal string).
LABEL_REPLICA: Final = f"{GROUP}/replica"
#: ``prefill``, ``decode`` or ``frontend`` (see :class:`Role` and :data:`ROLE_FRONTEND`).
LABEL_ROLE: Final = f"{GROUP}/role"
#: The engine's ordinal within its role and replica (decimal string).
LABEL_ORDINAL: Final = f"{GROUP}/ordinal"
#: The frontend index within its replica (decimal string).
LABEL_FRONTEND: Final = f"{GROUP}/frontend"
#: On the pods of a frontend's ``-standby`` Deployment (``spec.frontend.standby``): ``1``, its snowflake
#: process id (the Deployment named after the frontend runs process 0 and carries no such label).
LABEL_FRONTEND_PROCESS: Final = f"{GROUP}/frontend-process"
#: The rank of a pod inside an engine that spans nodes (``0`` serves HTTP).
LABEL_RANK: Final = f"{GROUP}/rank"
#: On the DisaggReplicaSet: the weights version of the last refit that reached every engine,
#: written by the trainer's sidecar; the operator copies it into ``status.weights``.
ANNOTATION_WEIGHTS_VERSION: Final = f"{GROUP}/weights-version"
#: On the DisaggReplicaSet: JSON ``{engine name: weights version}`` as the trainer's sidecar last
#: read them from the engines; the operator copies them into ``replicaStatuses[].engines[]``.
ANNOTATION_ENGINE_WEIGHTS: Final = f"{GROUP}/engine-weights"
#: On the DisaggReplicaSet: JSON ``drs_protocol.weights_state.DesiredWeights``, the weights the
#: fleet must hold, written by the trainer's sidecar as a refit starts; the operator copies it into
#: ``status.weights.desired`` and the fleet's weights ConfigMap.
ANNOTATION_DESIRED_WEIGHTS: Final = f"{GROUP}/desired-weights"
#: On each engine pod: a digest of the desired weights the operator last stored in the weights
#: ConfigMap (``weights_touch``). Writing it is an update of the pod object, which makes the kubelet
#: sync the pod at once and so refresh its mounted ConfigMap within seconds instead of at its
#: periodic sync (a minute by default). Not in the pod template: nothing rolls.
ANNOTATION_DESIRED_WEIGHTS_TOUCH: Final = f"{GROUP}/desired-weights-touch"
#: On the DisaggReplicaSet: any new value rotates both token Secrets (``manifests.rotation``).
ANNOTATION_ROTATE_TOKENS: Final = f"{GROUP}/rotate-tokens"
#: On the DisaggReplicaSet: seconds each rotation phase lasts (default ``rotation.WINDOW_S``).
ANNOTATION_ROTATION_WINDOW: Final = f"{GROUP}/token-rotation-window-seconds"
#: On a token Secret: the rotation's phase (``next`` or ``previous``: the key it holds), since when
#: (RFC 3339), and the ``rotate-tokens`` value last acted on: the rotation's memory.
ANNOTATION_ROTATION_PHASE: Final = f"{GROUP}/token-rotation-phase"
ANNOTATION_ROTATION_SINCE: Final = f"{GROUP}/token-rotation-since"
ANNOTATION_ROTATION_REQUEST: Final = f"{GROUP}/token-rotation-request"


#: The ``disagg.dev/role`` value of frontend children.
ROLE_FRONTEND: Final = "frontend"

#: Kinds of the children the operator owns (the Secret is created once and never compared).
CHILD_KINDS: Final = ("Pod", "Deployment", "Service", "ConfigMap", "Secret", "NetworkPolicy")
#: The children compared by spec hash and rolled when it changes.
HASHED_CHILD_KINDS: Final = ("Pod", "Deployment", "Service", "ConfigMap", "NetworkPolicy")
#: In the live children of a reconcile: the pods of its frontend Deployments by name (their
#: controller is a ReplicaSet, not the DisaggReplicaSet), read for why a frontend pod cannot run.
FRONTEND_PODS: Final = "FrontendPod"

# --- scheduling -----------------------------------------------------------------------------
GPU_RESOURCE: Final = "nvidia.com/gpu"
DEFAULT_SEGMENT_LABEL: Final = "nvidia.com/gpu.clique"
#: How long a replica stays on a node that is not Ready before it moves: Kubernetes' own default
#: toleration of the not-ready/unreachable taints (kube-apiserver
#: ``--default-not-ready-toleration-seconds``), after which a pod there would be evicted anyway.
DEFAULT_NOT_READY_TOLERATION_S: Final = 300
#: The taints the node lifecycle controller puts on a node that is not Ready (NoSchedule and NoExecute).
NODE_NOT_READY_TAINTS: Final = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")

# --- limits ---------------------------------------------------------------------------------
#: Frontend node ids are 8 bits (the snowflake request id), so N × F ≤ 256.
MAX_FRONTENDS: Final = NODE_IDS
MAX_PORT: Final = 65535
MIN_PORT: Final = 1
#: Longest DisaggReplicaSet name: the longest child name (an engine pod's hostname, a DNS label)
#: must stay within 63 characters. ``names.py`` holds the arithmetic; a test checks it.
MAX_NAME_LENGTH: Final = 40
MAX_ENGINES_PER_ROLE: Final = 64
MAX_TENSOR_PARALLEL: Final = 256


# --- status ---------------------------------------------------------------------------------
class ConditionType(StrEnum):
    """``status.conditions[].type`` values."""

    VALID = "Valid"
    PLACED = "Placed"
    READY = "Ready"
    PROGRESSING = "Progressing"
    DEGRADED = "Degraded"
    #: engines do not (yet) hold ``status.weights.desired``; independent of ``Ready`` (serving capacity)
    WEIGHTS_PENDING = "WeightsPending"
    #: every ``spec.networkPolicy.engineClients`` peer with a selector selects a pod (only while
    #: the policies are enabled with peers; ``drs_operator.policy_peers``)
    POLICY_PEERS_MATCH = "PolicyPeersMatch"
    #: each frontend URL runs a standby process (``spec.frontend.standby``; False on the host
    #: network or when turned off: a killed frontend pod or process darkens its URL until it is back)
    FRONTEND_STANDBY = "FrontendStandby"


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Reason(StrEnum):
    """``status.conditions[].reason`` values (UpperCamelCase, as metav1.Condition requires)."""

    # Valid
    SPEC_VALID = "SpecValid"
    SPEC_INVALID = "SpecInvalid"
    # Placed
    ALL_REPLICAS_PLACED = "AllReplicasPlaced"
    REPLICAS_SPLIT = "ReplicasSplitAcrossSegments"
    REPLICAS_UNPLACED = "ReplicasUnplaced"
    REPLICA_MOVED = "ReplicaMoved"
    # Ready
    ALL_REPLICAS_READY = "AllReplicasReady"
    REPLICAS_NOT_READY = "ReplicasNotReady"
    # Progressing
    CREATING = "Creating"
    UPDATING = "Updating"
    RECONCILED = "Reconciled"
    # Degraded
    NODE_LOST = "NodeLost"
    ENGINE_FAILED = "EngineFailed"
    PODS_NOT_RUNNING = "PodsNotRunning"
    WEIGHTS_SPLIT = "WeightsSplit"
    NOT_DEGRADED = "NotDegraded"
    # WeightsPending (only once the fleet has desired weights)
    WEIGHTS_PENDING = "WeightsPending"
    WEIGHTS_CURRENT = "AllEnginesHoldDesiredWeights"
    # PolicyPeersMatch (only with spec.networkPolicy.enabled and engineClients)
    POLICY_PEERS_MATCH = "PolicyPeersMatchPods"
    POLICY_PEER_SELECTS_NOTHING = "PolicyPeerSelectsNothing"
    # FrontendStandby (a fleet with frontends)
    STANDBY_PER_URL = "StandbyPerURL"
    HOST_NETWORK_ONE_PROCESS = "HostNetworkOneProcessPerURL"
    STANDBY_OFF = "StandbyOff"


class EventType(StrEnum):
    """``Event.type``."""

    NORMAL = "Normal"
    WARNING = "Warning"


class EventReason(StrEnum):
    """``Event.reason`` of the Events that are not a condition's transition (those carry the
    condition's :class:`Reason`)."""

    ENGINES_CREATED = "EnginesCreated"
    ENGINES_RECREATED = "EnginesRecreated"
    FRONTENDS_APPLIED = "FrontendsApplied"
    #: one Warning per engine pod whose cause (unschedulable, image pull, crash loop …) changes
    POD_NOT_RUNNING = "PodNotRunning"
    # an engine wider than a node (a gang of pods over one Ray cluster)
    GANG_RESTARTING = "GangRestarting"
    GANG_READY = "GangReady"
    # the fleet's token Secrets (drs_operator.manifests.secrets)
    TOKEN_SECRET_CREATED = "TokenSecretCreated"
    #: a token Secret was missing while pods that read it run: re-created with a new token
    TOKEN_SECRET_RECREATED = "TokenSecretRecreated"
    #: a rotation's phases (``manifests.rotation``): new token accepted; presented; old one dropped
    TOKEN_ROTATION_STARTED = "TokenRotationStarted"
    TOKEN_ROTATION_SWITCHED = "TokenRotationSwitched"
    TOKEN_ROTATION_DONE = "TokenRotationDone"
    #: the rotation window annotation is not a whole number of seconds in bounds
    TOKEN_ROTATION_INVALID = "TokenRotationInvalid"


class Phase(StrEnum):
    """``status.phase``: a one-word summary for ``kubectl get drs`` (conditions hold the detail)."""

    PENDING = "Pending"
    PROGRESSING = "Progressing"
    READY = "Ready"
    DEGRADED = "Degraded"
    INVALID = "Invalid"


# --- defaults -------------------------------------------------------------------------------
#: A frontend's and an engine's own defaults (``drs frontend`` / ``drs engine`` without a config).
DEFAULT_BASE_PORT: Final = frontend_config.DEFAULT_PORT
DEFAULT_ENGINE_PORT: Final = engine_config.DEFAULT_PORT
DEFAULT_MAX_SESSIONS: Final = frontend_config.DEFAULT_MAX_SESSIONS
DEFAULT_GROUP_HOLD_SECONDS: Final = frontend_config.DEFAULT_GROUP_HOLD_SECONDS
MAX_GROUP_HOLD_SECONDS: Final = frontend_config.MAX_GROUP_HOLD_SECONDS
DEFAULT_MODEL_MOUNT_PATH: Final = "/models"
#: The project's images (the engine image adds TensorRT-LLM to the same Python package).
DEFAULT_ENGINE_IMAGE: Final = "ghcr.io/disagg-dev/drs-engine:0.1.0"
DEFAULT_FRONTEND_IMAGE: Final = "ghcr.io/disagg-dev/drs:0.1.0"
