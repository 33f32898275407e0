"""``compute_status``: the status a reconcile writes, and the Events its transitions deserve.

Pure: the previous status, what was decided (validation problems, plan, placement, roll out) and
what is live in; the new status and a list of :class:`EventNote` out. Conditions follow the
``metav1.Condition`` rules: ``lastTransitionTime`` moves only when a condition's status flips,
and an Event is emitted on a flip (or a changed reason), never as storage.

Readiness: an engine is ready when all its pods exist, carry the desired spec hash and are Ready;
a frontend when its Deployment reports a ready, updated pod; a replica when it is placed and all
its engines and frontends are ready.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from drs_protocol.limits import MAX_WEIGHTS_VERSION_CHARS

from drs_operator.api import names
from drs_operator.api.constants import ConditionStatus, ConditionType, Phase, Reason
from drs_operator.api.status import Condition, DisaggReplicaSetStatus, EngineStatus, ReplicaStatus, WeightsStatus
from drs_operator.manifests.children import Children, hash_of
from drs_operator.rollout import Rollout, deployment_ready, pod_ready
from drs_operator.validation import Problem

Manifest = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class EventNote:
    type: str  #: Normal or Warning
    reason: str
    message: str


@dataclasses.dataclass(frozen=True)
class Observed:
    """What the reconcile decided and saw, for the status."""

    generation: int
    problems: Sequence[Problem] = ()
    replica_statuses: Sequence[ReplicaStatus] = ()  #: from layout.replica_statuses (placement)
    urls: Sequence[str | None] = ()
    replica_width: int | None = None
    gpus: int = 0
    desired: Children | None = None
    live: Mapping[str, Mapping[str, Manifest]] = dataclasses.field(default_factory=dict)
    rollout: Rollout | None = None
    moved: Sequence[int] = ()  #: replicas moved off lost nodes in this pass
    #: the ``disagg.dev/weights-version`` annotation (the trainer sidecar's last completed refit)
    weights_version: str | None = None


def _cond(
    previous: Sequence[Condition],
    type_: ConditionType,
    status: bool,
    reason: Reason,
    message: str,
    generation: int,
    now: datetime.datetime,
) -> Condition:
    st = ConditionStatus.TRUE if status else ConditionStatus.FALSE
    old = next((c for c in previous if c.type == type_), None)
    when = old.last_transition_time if old is not None and old.status == st else now
    return Condition(
        type=str(type_),
        status=st,
        reason=str(reason),
        message=message,
        last_transition_time=when,
        observed_generation=generation,
    )


def _engine_ready(es: EngineStatus, desired: Children | None, pods: Mapping[str, Manifest]) -> bool:
    if desired is None:
        return False
    want = {n: p for n, p in desired.all_of("Pod").items() if n == es.name or n.startswith(f"{es.name}-w")}
    return bool(want) and all(
        n in pods and hash_of(pods[n]) == hash_of(p) and pod_ready(pods[n]) for n, p in want.items()
    )


def _frontend_ready(drs: str, replica: int, index: int, deps: Mapping[str, Manifest], desired: Children | None) -> bool:
    name = names.frontend_name(drs, replica, index)
    want = desired.all_of("Deployment").get(name) if desired else None
    dep = deps.get(name)
    return want is not None and dep is not None and hash_of(dep) == hash_of(want) and deployment_ready(dep)


def compute_status(
    drs: str, previous: DisaggReplicaSetStatus, observed: Observed, now: datetime.datetime
) -> tuple[DisaggReplicaSetStatus, list[EventNote]]:
    gen = observed.generation
    prev = previous.conditions
    if observed.problems:
        message = "; ".join(f"{p.path}: {p.message}" for p in observed.problems)
        valid = _cond(prev, ConditionType.VALID, False, Reason.SPEC_INVALID, message, gen, now)
        conditions = [valid, *(c for c in prev if c.type != ConditionType.VALID)]
        status = previous.model_copy(
            update={
                "observed_generation": gen,
                "phase": Phase.INVALID,
                "conditions": conditions,
                "selector": names.selector(drs),
                "weights": weights_status(previous.weights, observed.weights_version, now),
            }
        )
        return status, _transitions(prev, conditions)

    pods = observed.live.get("Pod", {})
    deps = observed.live.get("Deployment", {})
    replicas: list[ReplicaStatus] = []
    for rs in observed.replica_statuses:
        engines = [
            e.model_copy(update={"ready": rs.placed and _engine_ready(e, observed.desired, pods)}) for e in rs.engines
        ]
        frontends = [
            f.model_copy(
                update={"ready": rs.placed and _frontend_ready(drs, rs.index, f.index, deps, observed.desired)}
            )
            for f in rs.frontends
        ]
        is_ready = rs.placed and all(e.ready for e in engines) and all(f.ready for f in frontends)
        replicas.append(rs.model_copy(update={"engines": engines, "frontends": frontends, "ready": is_ready}))

    n = len(replicas)
    ready_count = sum(r.ready for r in replicas)
    unplaced = [r for r in replicas if not r.placed]
    split = [r for r in replicas if r.split]
    valid = _cond(prev, ConditionType.VALID, True, Reason.SPEC_VALID, "spec is valid", gen, now)
    if unplaced:
        placed = _cond(
            prev,
            ConditionType.PLACED,
            False,
            Reason.REPLICAS_UNPLACED,
            "; ".join(r.reason or "" for r in unplaced),
            gen,
            now,
        )
    elif split:
        placed = _cond(
            prev,
            ConditionType.PLACED,
            True,
            Reason.REPLICAS_SPLIT,
            "; ".join(r.reason or f"replica {r.index} split" for r in split),
            gen,
            now,
        )
    else:
        placed = _cond(prev, ConditionType.PLACED, True, Reason.ALL_REPLICAS_PLACED, f"{n} replica(s) placed", gen, now)
    ready = _cond(
        prev,
        ConditionType.READY,
        n > 0 and ready_count == n,
        Reason.ALL_REPLICAS_READY if n > 0 and ready_count == n else Reason.REPLICAS_NOT_READY,
        f"{ready_count}/{n} replicas ready",
        gen,
        now,
    )
    rollout = observed.rollout
    in_flight = bool(rollout and (rollout.actions or rollout.waiting)) or ready_count < n - len(unplaced)
    if in_flight:
        not_ready = [str(r.index) for r in replicas if r.placed and not r.ready]
        msg = (rollout.message if rollout else "") or (
            f"starting replica {', '.join(not_ready)}" if not_ready else "applying changes"
        )
        reason = (
            Reason.UPDATING
            if any(c.type == ConditionType.READY and c.status == ConditionStatus.TRUE for c in prev)
            else Reason.CREATING
        )
        progressing = _cond(prev, ConditionType.PROGRESSING, True, reason, msg, gen, now)
    else:
        progressing = _cond(
            prev, ConditionType.PROGRESSING, False, Reason.RECONCILED, "all children match the spec", gen, now
        )
    if observed.moved:
        degraded = _cond(
            prev,
            ConditionType.DEGRADED,
            True,
            Reason.NODE_LOST,
            f"replica {', '.join(map(str, observed.moved))} moved off lost or unschedulable nodes",
            gen,
            now,
        )
    elif unplaced:
        degraded = _cond(
            prev,
            ConditionType.DEGRADED,
            True,
            Reason.REPLICAS_UNPLACED,
            f"{len(unplaced)} replica(s) not placed",
            gen,
            now,
        )
    elif n and ready.status != ConditionStatus.TRUE and not in_flight:
        degraded = _cond(
            prev,
            ConditionType.DEGRADED,
            True,
            Reason.ENGINE_FAILED,
            f"{n - ready_count} replica(s) not ready",
            gen,
            now,
        )
    else:
        degraded = _cond(prev, ConditionType.DEGRADED, False, Reason.NOT_DEGRADED, "", gen, now)
    conditions = [valid, placed, ready, progressing, degraded]

    if ready.status == ConditionStatus.TRUE and progressing.status == ConditionStatus.FALSE:
        phase = Phase.READY
    elif unplaced and ready_count == 0:
        phase = Phase.PENDING
    elif degraded.status == ConditionStatus.TRUE and not in_flight:
        phase = Phase.DEGRADED
    else:
        phase = Phase.PROGRESSING
    status = DisaggReplicaSetStatus(
        observed_generation=gen,
        replicas=n,
        ready_replicas=ready_count,
        selector=names.selector(drs),
        phase=phase,
        gpus=observed.gpus,
        replica_width=observed.replica_width,
        conditions=conditions,
        urls=[u or "" for u in observed.urls],
        replica_statuses=replicas,
        weights=weights_status(previous.weights, observed.weights_version, now),
    )
    return status, _transitions(prev, conditions)


def weights_status(
    previous: WeightsStatus | None, annotated: str | None, now: datetime.datetime
) -> WeightsStatus | None:
    """``status.weights`` from the sidecar's annotation: a new version is stamped with ``now``, the
    same version keeps its time, and no annotation keeps what status had."""
    if not annotated or len(annotated) > MAX_WEIGHTS_VERSION_CHARS:
        return previous
    if previous is not None and previous.version == annotated:
        return previous
    return WeightsStatus(version=annotated, last_update_time=now)


def _transitions(previous: Sequence[Condition], current: Sequence[Condition]) -> list[EventNote]:
    """An Event for each condition whose status or reason changed (Warnings for bad news)."""
    bad = {
        ConditionType.VALID: ConditionStatus.FALSE,
        ConditionType.PLACED: ConditionStatus.FALSE,
        ConditionType.DEGRADED: ConditionStatus.TRUE,
    }
    notes = []
    for c in current:
        old = next((p for p in previous if p.type == c.type), None)
        if old is not None and old.status == c.status and old.reason == c.reason:
            continue
        if (
            old is None
            and c.type in (ConditionType.PROGRESSING, ConditionType.DEGRADED)
            and c.status == ConditionStatus.FALSE
        ):
            continue
        warn = bad.get(ConditionType(c.type)) == c.status
        notes.append(EventNote("Warning" if warn else "Normal", c.reason, f"{c.type}={c.status}: {c.message}"[:1024]))
    return notes


def status_dict(status: DisaggReplicaSetStatus) -> dict[str, Any]:
    """The status as the API stores it (camelCase JSON, RFC 3339 times)."""
    data: dict[str, Any] = status.model_dump(mode="json", by_alias=True, exclude_none=True)
    for c in data.get("conditions", []):
        c["lastTransitionTime"] = _rfc3339(c["lastTransitionTime"])
    return data


def _rfc3339(value: str) -> str:
    dt = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    return dt.astimezone(datetime.UTC).replace(microsecond=0).strftime("%Y-%m-%dT%H:%M:%SZ")
