"""The answers of the sidecar's trainer API (:class:`~drs_protocol.routes.TrainerRoute`).

Its requests are :mod:`drs_protocol.control`'s trainer models (``Refit``, ``TrainerCollectiveInit``,
``PrepareRefitInfo``, ``TrainerCollectiveUpdate``, ``TrainerIpcUpdate``, ``MemoryTags``), which forbid
unknown fields (a typo is a 400 naming it). The sidecar (``drs_sidecar.app``) answers in the shapes
of the models here and the trainer's library (``drs_client``) parses them with the same models.
Answers ignore unknown fields, so a client of an older release still reads a newer sidecar
(``tests/sidecar/test_trainer_api.py`` checks that every answer the sidecar gives is exactly what its model dumps, so no field goes unmodelled).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from drs_protocol.routes import ControlOp


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- answers --------------------------------------------------------------------------------


class EngineOutcome(_Answer):
    """What one engine answered to one fan-out (``detail``: its status and reason when not ok)."""

    engine: str
    role: str
    replica: int
    url: str | None
    ok: bool
    detail: str
    #: the weights the engine answered it holds after the call (None: it did not say)
    weights_version: str | None = None
    weights_digest: str | None = None
    elapsed_s: float


class PendingEngine(_Answer):
    """An engine the fan-out could not call (not ready)."""

    engine: str
    role: str
    replica: int


class GroupAbort(_Answer):
    """A failed collective step, aborted on every member (``drs_sidecar.group_abort``): the
    culprits (engines, or ``the trainer``), each failed member's fault (``hung``, ``died``,
    ``failed``, ``collateral``), and which members acknowledged the abort."""

    culprits: list[str]
    faults: dict[str, str]
    message: str
    aborted: list[str]
    unanswered: list[str]


class FanOutReport(_Answer):
    """The answer of every fan-out route (200 when ``complete``, else 502)."""

    op: ControlOp
    complete: bool
    engines: int = Field(description="engines of the fleet: called + pending")
    ok: int
    failed: list[EngineOutcome]
    pending: list[PendingEngine]
    outcomes: list[EngineOutcome]
    #: the digest every engine had to hold (the trainer's, else the engines' agreed one; None: none)
    weights_digest: str | None = None
    #: a failed collective step: the group's abort and its culprit (None: none was needed)
    group_abort: GroupAbort | None = None
    #: a refit: seconds from its start until every engine had been told the target weights
    #: (``POST /control/weights/target``, before any load); None: none announced
    target_announced_s: float | None = None
    #: a refit: its cut-over (epoch seconds, :mod:`drs_protocol.cutover`) and the margin it got
    #: (None: not announced)
    effective_at: float | None = None
    cutover_margin_s: float | None = None
    #: the announce round ended after the cut-over: engines told late may have answered turns
    #: that started after it at the old weights (they count them: ``late_legs``)
    announce_exceeded_margin: bool = False
    late_legs: int = Field(0, ge=0)
    elapsed_s: float


class GroupMember(_Answer):
    engine: str
    width: int
    rank_prefix: int
    ranks: list[int] = Field(description="first and last global rank of the engine")


class GroupLayout(_Answer):
    """The collective refit group: the trainer's ranks first, then each engine's."""

    train_world_size: int
    world_size: int
    engines: list[GroupMember]


class CollectiveInitReport(FanOutReport):
    """``POST /v1/collective/init``'s answer: the report and the group it formed."""

    group: GroupLayout


class DesiredWeights(_Answer):
    """The fleet's desired weights as the sidecar stored them (``path`` None: a broadcast refit)."""

    path: str | None
    version: str
    digest: str | None = None


class FleetEngine(_Answer):
    """One engine in ``GET /v1/fleet``: ``weights_version`` as it answers now (None: no answer)."""

    engine: str
    role: str
    replica: int
    url: str | None
    ready: bool
    weights_version: str | None
    weights_digest: str | None = None


class FleetReport(_Answer):
    """``GET /v1/fleet``: every engine with the version and digest it holds, the desired and published
    weights."""

    desired: DesiredWeights | None
    published: str | None
    refitting: bool
    collective_group: GroupLayout | None
    engines: list[FleetEngine]
