"""The Events a status change deserves (pure): a condition that flipped or changed its reason
(:func:`transitions`), a pod that cannot run for a new reason (:func:`problem_notes`), an engine
wider than a node that went down or came back whole (:func:`gang_notes`). ``compute_status``
(:mod:`drs_operator.conditions`) returns them beside the status."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from drs_operator.api.constants import ConditionStatus, ConditionType, EventReason, EventType
from drs_operator.api.status import Condition, DisaggReplicaSetStatus, ReplicaStatus


@dataclasses.dataclass(frozen=True)
class EventNote:
    type: EventType
    reason: str  #: a condition's Reason (a transition) or an EventReason
    message: str


def gang_notes(previous: Sequence[ReplicaStatus], current: Sequence[ReplicaStatus]) -> list[EventNote]:
    """Events for engines wider than a node that stopped being ready (the gang restarts) or came back."""
    before = {e.name: e.ready for r in previous for e in r.engines}
    notes = []
    for r in current:
        for e in r.engines:
            if not e.ranks or e.name not in before or before[e.name] == e.ready:
                continue
            if e.ready:
                notes.append(
                    EventNote(
                        EventType.NORMAL,
                        EventReason.GANG_READY,
                        f"engine {e.name}: all {len(e.ranks)} ranks joined, serving",
                    )
                )
                continue
            missing = ", ".join(f"{x.rank} ({x.pod} on {x.node})" for x in e.ranks if not x.joined) or "none"
            message = (
                f"engine {e.name} is down as a whole, rank(s) not joined: {missing}; "
                "its ranks restart together and it serves again once every rank rejoined"
            )
            notes.append(EventNote(EventType.WARNING, EventReason.GANG_RESTARTING, message[:1024]))
    return notes


def problem_notes(previous: DisaggReplicaSetStatus, replicas: Sequence[ReplicaStatus]) -> list[EventNote]:
    """A Warning Event for each engine or frontend whose pod cannot run for a reason it did not have before."""
    before = {e.name: e.problem for r in previous.replica_statuses for e in r.engines}
    notes = [
        EventNote(EventType.WARNING, EventReason.POD_NOT_RUNNING, (e.message or e.problem or "")[:1024])
        for r in replicas
        for e in r.engines
        if e.problem and before.get(e.name) != e.problem
    ]
    fronts_before = {(r.index, f.index): f.problem for r in previous.replica_statuses for f in r.frontends}
    notes += [
        EventNote(EventType.WARNING, EventReason.POD_NOT_RUNNING, (f.message or f.problem or "")[:1024])
        for r in replicas
        for f in r.frontends
        if f.problem and fronts_before.get((r.index, f.index)) != f.problem
    ]
    return notes


def transitions(previous: Sequence[Condition], current: Sequence[Condition]) -> list[EventNote]:
    """An Event for each condition whose status or reason changed (Warnings for bad news)."""
    bad = {
        ConditionType.VALID: ConditionStatus.FALSE,
        ConditionType.PLACED: ConditionStatus.FALSE,
        ConditionType.DEGRADED: ConditionStatus.TRUE,
        ConditionType.WEIGHTS_PENDING: ConditionStatus.TRUE,
        ConditionType.POLICY_PEERS_MATCH: ConditionStatus.FALSE,
    }
    notes = []
    for c in current:
        old = next((p for p in previous if p.type == c.type), None)
        if old is not None and old.status == c.status and old.reason == c.reason:
            continue
        if (
            old is None
            and c.type in (ConditionType.PROGRESSING, ConditionType.DEGRADED, ConditionType.WEIGHTS_PENDING)
            and c.status == ConditionStatus.FALSE
        ):
            continue
        if old is None and c.type == ConditionType.POLICY_PEERS_MATCH and c.status == ConditionStatus.TRUE:
            continue
        if old is None and c.type == ConditionType.FRONTEND_STANDBY:  # the fleet's shape, not news
            continue
        warn = bad.get(ConditionType(c.type)) == c.status
        notes.append(
            EventNote(
                EventType.WARNING if warn else EventType.NORMAL, c.reason, f"{c.type}={c.status}: {c.message}"[:1024]
            )
        )
    return notes
