"""``DisaggReplicaSet.status``: what the trainer, its sidecar and a person read.

Written only by the operator. ``urls`` is the contract with the client: the N×F frontend URLs,
replica-major (r0f0, r0f1, …, r1f0, …), stable for the life of the resource with pod networking.
``replicaStatuses`` is also the operator's memory of the placement (``placement.previous_from_status``
rebuilds the sticky input from it). Unknown fields are ignored when parsing, so an older or newer
operator can read what another wrote.
"""

from __future__ import annotations

from datetime import datetime

from drs_protocol.config import CamelModel
from drs_protocol.limits import MAX_WEIGHTS_VERSION_CHARS
from drs_protocol.weights_digest import DIGEST_PATTERN
from pydantic import ConfigDict, Field

from drs_operator.api.constants import MAX_FRONTENDS, ConditionStatus, Phase, Role


class StatusModel(CamelModel):
    """Base of the status models: camelCase aliases, unknown fields ignored, immutable."""

    model_config = ConfigDict(extra="ignore", frozen=True)


class Condition(StatusModel):
    """A condition in the metav1.Condition shape."""

    type: str = Field(min_length=1, max_length=316, description="Condition type, e.g. Valid, Placed, Ready.")
    status: ConditionStatus
    reason: str = Field(min_length=1, max_length=1024, description="UpperCamelCase reason (see the Reason constants).")
    message: str = Field("", max_length=32768, description="What a person needs to act on.")
    last_transition_time: datetime = Field(description="When status last changed.")
    observed_generation: int | None = Field(None, ge=0, description="The spec generation this condition was set for.")


class RankStatus(StatusModel):
    """One pod of an engine wider than a node (the engine runs as a gang over one Ray cluster)."""

    rank: int = Field(ge=0, le=255, description="0: the leader (Ray head + engine server); above: a joined Ray node.")
    pod: str = Field(max_length=253)
    node: str | None = Field(None, max_length=253)
    joined: bool = Field(
        False,
        description="The pod is Ready: rank > 0, its Ray node is in the leader's cluster; rank 0, the gang serves.",
    )


class EngineStatus(StatusModel):
    """One engine: where it runs, its address and readiness."""

    name: str = Field(max_length=253)
    role: Role = Field(description="prefill or decode.")
    ordinal: int = Field(ge=0)
    width: int = Field(ge=1, description="GPUs of the engine.")
    nodes: list[str] = Field(default_factory=list, max_length=256, description="Nodes, one per pod (rank order).")
    node: str | None = Field(None, max_length=253, description="The node of rank 0 (the pod serving HTTP).")
    url: str | None = Field(None, max_length=512, description="The engine's base URL.")
    ready: bool = Field(False, description="Every pod of the engine is ready (serving), at any spec hash.")
    updated: bool = Field(False, description="Ready, and every pod carries the current spec.")
    weights_version: str | None = Field(
        None,
        max_length=MAX_WEIGHTS_VERSION_CHARS,
        description="Weights version the engine serves, as it answered the operator's weights query "
        "(absent: not serving, or no answer in the last pass).",
    )
    weights_digest: str | None = Field(
        None,
        pattern=DIGEST_PATTERN,
        description="Digest of the weights the engine holds (drs_protocol.weights_digest), measured by the engine "
        "over its bytes, as it answered the operator's weights query.",
    )
    problem: str | None = Field(
        None, max_length=128, description="Why a pod of the engine does not run (e.g. Unschedulable, ImagePullBackOff)."
    )
    message: str | None = Field(None, max_length=1024, description="The scheduler's or kubelet's words for it.")
    ranks: list[RankStatus] | None = Field(
        None, max_length=256, description="An engine wider than a node: its pods in rank order (absent for one pod)."
    )


class FrontendStatus(StatusModel):
    """One frontend of a replica."""

    index: int = Field(ge=0, description="Frontend index f within the replica.")
    url: str | None = Field(None, max_length=512)
    port: int = Field(ge=1, le=65535)
    node_id: int = Field(ge=0, le=MAX_FRONTENDS - 1, description="Snowflake node id r*F + f.")
    node: str | None = Field(None, max_length=253)
    ready: bool = Field(
        False,
        description="A pod of the frontend (its own or, with frontend.standby, its standby's) is ready, at any spec hash.",
    )
    updated: bool = Field(False, description="Ready, and every Deployment of the frontend runs the current spec.")
    standby_ready: bool | None = Field(
        None, description="frontend.standby: the standby's pod is ready (absent without a standby)."
    )
    problem: str | None = Field(
        None,
        max_length=128,
        description="Why a pod of the frontend does not run (e.g. Unschedulable, ImagePullBackOff).",
    )
    message: str | None = Field(None, max_length=1024, description="The scheduler's or kubelet's words for it.")


class ReplicaStatus(StatusModel):
    """One replica: its placement, engines and frontends."""

    index: int = Field(ge=0)
    placed: bool = False
    nodes: list[str] = Field(default_factory=list, max_length=1024)
    segment: str | None = Field(None, max_length=317, description="The segment holding the replica; absent when split.")
    split: bool = Field(False, description="True when the replica spans more than one segment.")
    reason: str | None = Field(None, max_length=4096, description="Why the replica is split or not placed.")
    ready: bool = Field(False, description="Placed, and every engine and frontend is ready (serving).")
    updated: bool = Field(False, description="Ready, and every engine and frontend runs the current spec.")
    engines: list[EngineStatus] = Field(default_factory=list, max_length=128)
    frontends: list[FrontendStatus] = Field(default_factory=list, max_length=MAX_FRONTENDS)


class DesiredWeightsStatus(StatusModel):
    """The weights the fleet must hold (``disagg.dev/desired-weights``, stored by the trainer's
    sidecar as a refit starts; the engines read it at their start from the weights ConfigMap)."""

    version: str = Field(max_length=MAX_WEIGHTS_VERSION_CHARS)
    path: str | None = Field(None, max_length=4096, description="Checkpoint the engines load them from.")
    digest: str | None = Field(None, pattern=DIGEST_PATTERN, description="Digest of their bytes.")
    effective_at: datetime | None = Field(
        None,
        description=(
            "The refit's cut-over (UTC, microseconds): turns the fleet received from then on"
            " (their x-drs-turn-started stamp) are answered at these weights; absent: desired at once."
        ),
    )


class WeightsStatus(StatusModel):
    """The weights the engines serve, and the weights they must."""

    version: str | None = Field(
        None, max_length=MAX_WEIGHTS_VERSION_CHARS, description="Weights version of the last completed refit."
    )
    last_update_time: datetime | None = None
    desired: DesiredWeightsStatus | None = Field(None, description="The weights the fleet must hold.")


#: Pods a token rotation's status names at most (the rest are counted in ``laggingCount``).
MAX_LAGGING_PODS = 10


class TokenRotationStatus(StatusModel):
    """A token Secret whose rotation is under way (``drs_operator.manifests.rotation``)."""

    secret: str = Field(max_length=253, description="The token Secret being rotated.")
    phase: str = Field(
        max_length=16,
        description="next: the new token is accepted, not yet presented; previous: presented, the old one still accepted.",
    )
    since: datetime | None = Field(None, description="When the phase began.")
    lagging_pods: list[str] | None = Field(
        None,
        max_length=MAX_LAGGING_PODS,
        description=(
            "Pods that mount the Secret and have not reported reading this phase in their /health answer (first "
            f"{MAX_LAGGING_PODS} by name); the phase waits on them until its window ends. Absent: not asked yet."
        ),
    )
    lagging_count: int | None = Field(None, ge=0, description="How many pods lag in all (absent: not asked yet).")


class DisaggReplicaSetStatus(StatusModel):
    """Observed state of a DisaggReplicaSet."""

    observed_generation: int | None = Field(None, ge=0)
    replicas: int = Field(0, ge=0, description="Replicas of the current plan (the scale subresource's status).")
    ready_replicas: int = Field(
        0, ge=0, description="Replicas whose engines and frontends all serve (at any spec hash, as in a roll)."
    )
    updated_replicas: int = Field(0, ge=0, description="Ready replicas whose every child runs the current spec.")
    selector: str | None = Field(
        None, max_length=1024, description="Label selector of the children (scale subresource)."
    )
    phase: Phase | None = Field(None, description="One-word summary: Pending, Progressing, Ready, Degraded or Invalid.")
    gpus: int = Field(0, ge=0, description="GPUs the plan uses (replicas × replica width).")
    replica_width: int | None = Field(None, ge=1)
    conditions: list[Condition] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    urls: list[str] = Field(
        default_factory=list,
        max_length=MAX_FRONTENDS,
        description=(
            "N×F frontend URLs, replica-major; always N×F long (clients hash sessions over it), an empty string "
            "for a frontend of a replica that is not placed (nothing listens there)."
        ),
    )
    replica_statuses: list[ReplicaStatus] = Field(default_factory=list, max_length=MAX_FRONTENDS)
    weights: WeightsStatus | None = Field(None, description="The weights the engines serve.")
    token_rotations: list[TokenRotationStatus] | None = Field(
        None,
        max_length=2,
        description="The token Secrets whose rotation is under way, and the pods each phase waits on; absent when none.",
    )
