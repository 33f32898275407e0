"""What one fan-out did (:class:`Report`: every engine's :class:`EngineOutcome`, the engines it
could not call) and its digest proof (:func:`verify_digests`): a weights operation counts on an
engine only when the digest it measured equals the expected one (:func:`expected_digest`)."""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from drs_protocol.routes import ControlOp
from drs_protocol.weights_state import DesiredWeights, HeldWeights

from drs_sidecar.control import CallResult
from drs_sidecar.fleet import Engine

log = logging.getLogger("drs_sidecar.refit")


@dataclass(frozen=True, slots=True)
class EngineOutcome:
    engine: str
    role: str
    replica: int
    url: str | None
    ok: bool
    detail: str
    elapsed_s: float
    weights_version: str | None = None  #: what the engine answered it holds afterwards
    weights_digest: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "role": self.role,
            "replica": self.replica,
            "url": self.url,
            "ok": self.ok,
            "detail": self.detail,
            "weights_version": self.weights_version,
            "weights_digest": self.weights_digest,
            "elapsed_s": round(self.elapsed_s, 3),
        }


@dataclass(slots=True)
class Report:
    """What one fan-out did: every ready engine's outcome, and the engines it could not call."""

    op: ControlOp
    outcomes: list[EngineOutcome] = field(default_factory=list)
    pending: list[Engine] = field(default_factory=list)
    elapsed_s: float = 0.0
    #: The digest every engine had to reach (a weights operation), None when none could be decided.
    digest: str | None = None
    #: A failed collective step's abort (:class:`drs_sidecar.group_abort.GroupAbort`): the culprit.
    group_abort: Any = None
    #: A refit: seconds from its start until every engine had been told the target (None: not announced).
    target_announced_s: float | None = None
    #: The refit's cut-over (epoch seconds, ``drs_protocol.cutover``) and the margin it got (None: not announced).
    effective_at: float | None = None
    cutover_margin_s: float | None = None
    #: The announce round ended after the cut-over (engines told late may have served new turns at the old weights).
    announce_exceeded_margin: bool = False
    #: Legs the engines answered at other weights after the cut-over, as they counted them (a late announce).
    late_legs: int = 0

    @property
    def failed(self) -> list[EngineOutcome]:
        return [o for o in self.outcomes if not o.ok]

    @property
    def complete(self) -> bool:
        return bool(self.outcomes) and not self.failed and not self.pending

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op.value,
            "complete": self.complete,
            "engines": len(self.outcomes) + len(self.pending),
            "ok": sum(o.ok for o in self.outcomes),
            "failed": [o.as_dict() for o in self.failed],
            "pending": [{"engine": e.name, "role": e.role, "replica": e.replica} for e in self.pending],
            "outcomes": [o.as_dict() for o in self.outcomes],
            "weights_digest": self.digest,
            "group_abort": None if self.group_abort is None else self.group_abort.as_dict(),
            "target_announced_s": None if self.target_announced_s is None else round(self.target_announced_s, 4),
            "effective_at": self.effective_at,
            "cutover_margin_s": None if self.cutover_margin_s is None else round(self.cutover_margin_s, 4),
            "announce_exceeded_margin": self.announce_exceeded_margin,
            "late_legs": self.late_legs,
            "elapsed_s": round(self.elapsed_s, 3),
        }


def expected_digest(outcomes: Sequence[EngineOutcome], desired: str | None) -> str | None:
    """The digest the engines must hold: ``desired`` when the trainer gave one, else the one most
    of the engines that answered with a digest hold (None on a tie: they disagree)."""
    if desired is not None:
        return desired
    counts = collections.Counter(o.weights_digest for o in outcomes if o.ok and o.weights_digest)
    ranked = counts.most_common(2)
    if not ranked or (len(ranked) == 2 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]


def verify_digests(report: Report, desired: str | None) -> Report:
    """Every outcome that answered 200 is failed unless the engine's digest is the expected one
    (:func:`expected_digest`); an engine that reports no digest stays ok, marked unverified."""
    expect = expected_digest(report.outcomes, desired)
    answered = [o.weights_digest for o in report.outcomes if o.ok and o.weights_digest]
    checked_outcomes = []
    for o in report.outcomes:
        if not o.ok:
            checked_outcomes.append(o)
        elif o.weights_digest is None:
            checked_outcomes.append(replace(o, detail="unverified: its backend computes no weights digest"))
        elif expect is None:
            seen = ", ".join(sorted(set(answered)))
            checked_outcomes.append(replace(o, ok=False, detail=f"weights digests disagree across engines ({seen})"))
        elif o.weights_digest != expect:
            what = "the trainer's" if desired is not None else "the other engines'"
            detail = f"holds weights digest {o.weights_digest}, not {what} {expect}: the load moved other bytes"
            checked_outcomes.append(replace(o, ok=False, detail=detail))
        else:
            checked_outcomes.append(o)
    report.outcomes = checked_outcomes
    report.digest = expect
    for failed in report.failed:
        log.warning("%s on %s (%s): %s", report.op, failed.engine, failed.url, failed.detail)
    return report


def holds_desired(answer: CallResult, desired: DesiredWeights) -> bool:
    """Whether an engine's ``GET /control/weights`` answer is at the desired weights (by digest
    when both are known)."""
    if answer.weights_version != desired.version:
        return False
    return desired.digest is None or answer.weights_digest is None or answer.weights_digest == desired.digest


def held_after(report: Report) -> dict[str, HeldWeights]:
    """What each engine that answered a weights operation holds now (as it answered)."""
    return {
        o.engine: HeldWeights(version=o.weights_version, digest=o.weights_digest)
        for o in report.outcomes
        if o.weights_version is not None
    }
