"""A collective step that cannot hang: every step bounded, and a failed one aborted on every member.

Every collective step (``init``, ``prepare``, ``update``) runs under the budget of
``drs sidecar --collective-timeout`` (:func:`drs_protocol.collective.step_deadlines`): each engine
is given ``timeout_s`` = ``engine_s`` for its own waits, the sidecar waits ``call_s`` at most for
each answer, and when any member failed the group is aborted on every member at once
(``POST /control/collective/abort``, each call within ``abort_s``), so the trainer's call returns
within the budget whatever the members do. The failed report carries the abort
(:class:`GroupAbort`): the culprit and why, which members acknowledged the abort. The sidecar then
drops its group; the next ``collective/init`` forms a new one from the fleet as it is then.

Who is the culprit (:func:`find_culprits`, pure), from each failed member's answer:

- **hung**: no answer within ``call_s`` (a stopped process, a wedged GPU thread);
- **died**: no answer at all (refused, reset: the process or its node is gone);
- **failed**: it answered an error of its own (a 4xx, 500, 501, 503; or a 200 whose digest is not
  the expected one);
- **collateral**: it answered 502 ``collective_error``: it waited on the group, and another rank
  did not come (never a culprit while another member is hung, died or failed).

The culprits are every hung, dead and failed member. When every failure is collateral, no engine
is to blame: the ranks that did not send are the trainer's own (``the trainer``).

Who is a member (:meth:`CollectiveSteps.members`): every engine of the fleet, each ready, as
before; and an engine not Ready only because it holds part of a failed update (its ``/health``
answers 503 ``weights_incomplete``) counts as ready for the group, since the refit is what it
waits for; the reconcile loop counts it the same way, so it loads the desired checkpoint on it. Without that, a failed update would leave its half-loaded engines outside every later
group, and a broadcast refit (no checkpoint path) could never bring them back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Final

from drs_protocol.collective import (
    COLLECTIVE_ERROR_TYPE,
    WEIGHTS_INCOMPLETE_ERROR_TYPE,
    StepDeadlines,
    step_deadlines,
)
from drs_protocol.control import CollectiveAbort
from drs_protocol.routes import ControlOp
from pydantic import BaseModel

from drs_sidecar.collective import GroupLayout
from drs_sidecar.control import CallResult, ControlClient
from drs_sidecar.fleet import Engine, Fleet
from drs_sidecar.report import EngineOutcome, Report

log = logging.getLogger(__name__)

#: Who is named when no engine is at fault.
THE_TRAINER = "the trainer"
#: Seconds to wait for a not-Ready engine's ``/health`` (why it is not Ready).
HEALTH_PROBE_S: Final = 2.0


class Fault(StrEnum):
    HUNG = "hung"
    DIED = "died"
    FAILED = "failed"
    COLLATERAL = "collateral"


#: The faults that make a member a culprit, in the order they are named.
CULPRIT_FAULTS = (Fault.HUNG, Fault.DIED, Fault.FAILED)


def fault_of(outcome: EngineOutcome, call: CallResult | None) -> Fault:
    """What went wrong on one failed member (see the module)."""
    if call is None or call.ok:
        return Fault.FAILED  # answered 200, failed by the digest check (or never called)
    if call.status is None:
        return Fault.HUNG if call.timed_out else Fault.DIED
    if call.status == 502 and call.error_type == COLLECTIVE_ERROR_TYPE:
        return Fault.COLLATERAL
    return Fault.FAILED


@dataclass(frozen=True, slots=True)
class Culprits:
    engines: list[str]  #: the members at fault; empty: the trainer
    faults: dict[str, Fault]  #: every failed member's fault
    message: str


def find_culprits(failed: Sequence[EngineOutcome], calls: dict[str, CallResult], train_world_size: int) -> Culprits:
    """The culprits among the failed members (``calls``: each member's answer by URL)."""
    faults = {o.engine: fault_of(o, calls.get(o.url or "")) for o in failed}
    details = {o.engine: o.detail for o in failed}
    named = [e for kind in CULPRIT_FAULTS for e, f in faults.items() if f is kind]
    if named:
        message = "; ".join(f"{e} {faults[e].value} ({details[e]})" for e in named)
    else:
        ranks = f"rank 0-{train_world_size - 1}" if train_world_size > 1 else "rank 0"
        message = (
            f"{THE_TRAINER} ({ranks}): every failed engine waited for the broadcast and it did not come "
            f"({'; '.join(f'{e}: {d}' for e, d in details.items())})"
        )
    return Culprits(named, faults, message)


@dataclass(slots=True)
class GroupAbort:
    """A failed step's abort: the culprit, and each member's answer to the abort."""

    culprits: Culprits
    aborted: list[str] = field(default_factory=list)  #: members that acknowledged the abort
    unanswered: list[str] = field(default_factory=list)  #: members whose abort failed or timed out

    def as_dict(self) -> dict[str, Any]:
        return {
            "culprits": self.culprits.engines or [THE_TRAINER],
            "faults": {e: f.value for e, f in self.culprits.faults.items()},
            "message": self.culprits.message,
            "aborted": self.aborted,
            "unanswered": self.unanswered,
        }


FanOut = Callable[..., Awaitable[Report]]


class CollectiveSteps:
    """The collective steps of one sidecar under one budget (``timeout_s`` per step)."""

    def __init__(self, control: ControlClient, timeout_s: float) -> None:
        self.control = control
        self.deadlines: StepDeadlines = step_deadlines(timeout_s)

    @property
    def engine_s(self) -> float:
        """The ``timeout_s`` each engine is given for its own part of a step."""
        return self.deadlines.engine_s

    async def run(
        self,
        fan_out: FanOut,
        op: ControlOp,
        group: GroupLayout,
        body_for: Callable[[str], BaseModel],
        *,
        desired_digest: str | None = None,
    ) -> Report:
        """``op`` on every member at once, each answer awaited ``call_s`` at most; when any member
        failed, the group is aborted on every member and the report says who is the culprit."""
        calls: dict[str, CallResult] = {}

        async def call(url: str) -> CallResult:
            result = await self.control.op(url, op, body_for(url), timeout=self.deadlines.call_s)
            calls[url] = result
            return result

        members = [m.engine for m in group.members]
        report = await fan_out(op, members, call, all_at_once=True, desired_digest=desired_digest)
        if report.failed:
            culprits = find_culprits(report.failed, calls, group.train_world_size)
            log.error("%s failed: %s; aborting the group on every member", op, culprits.message)
            report.group_abort = await self.abort(group, culprits, f"{op} failed: {culprits.message}")
        return report

    async def members(self, fleet: Fleet) -> list[Engine]:
        """The fleet's engines, those not Ready only for holding part of a failed update counted
        ready (each asked within :data:`HEALTH_PROBE_S`)."""
        engines = await fleet.engines()
        unready = [e for e in engines if e.url and not e.ready]
        answers = await asyncio.gather(*(self.control.health(e.url, HEALTH_PROBE_S) for e in unready if e.url))
        incomplete = {a.url for a in answers if a.status == 503 and a.error_type == WEIGHTS_INCOMPLETE_ERROR_TYPE}
        return [replace(e, ready=True) if e.url in incomplete else e for e in engines]

    async def abort(self, group: GroupLayout, culprits: Culprits, reason: str) -> GroupAbort:
        """``collective/abort`` on every member at once, each within ``abort_s``."""
        body = CollectiveAbort(reason=reason[:4096])
        urls = [m.engine.url for m in group.members if m.engine.url]
        answers = await asyncio.gather(
            *(self.control.op(url, ControlOp.ABORT_COLLECTIVE, body, timeout=self.deadlines.abort_s) for url in urls)
        )
        done = GroupAbort(culprits)
        by_url = {m.engine.url: m.engine.name for m in group.members}
        for answer in answers:
            (done.aborted if answer.ok else done.unanswered).append(by_url[answer.url])
        if done.unanswered:
            log.warning("the abort reached no answer from: %s", ", ".join(done.unanswered))
        return done
