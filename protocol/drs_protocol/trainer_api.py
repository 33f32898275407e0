"""Bodies of the sidecar's trainer API (:class:`~drs_protocol.routes.TrainerRoute`), both ways.

The sidecar (``drs_sidecar.app``) validates the requests with these models and answers in the
shapes of the answer models; the trainer's library (``drs_client``) builds the requests and parses
the answers with the same models. ``POST /v1/sleep`` and ``/v1/wake`` take
:class:`drs_protocol.control.MemoryTags`, the engines' own body.

Requests forbid unknown fields (a typo is a 400 naming it); answers ignore them, so a client of an
older release still reads a newer sidecar (``tests/sidecar/test_trainer_api.py`` checks that every
answer the sidecar gives is exactly what its model dumps, so no field goes unmodelled).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from drs_protocol.control import IpcBuffer
from drs_protocol.limits import MAX_WEIGHTS_VERSION_CHARS
from drs_protocol.routes import ControlOp


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- requests -------------------------------------------------------------------------------


class RefitRequest(_Request):
    """``POST /v1/refit``: every engine loads ``path`` and serves it as ``version``."""

    path: str = Field(min_length=1, description="checkpoint the engines load (a path they can read)")
    version: str = Field(min_length=1, max_length=MAX_WEIGHTS_VERSION_CHARS, description="the version they serve it as")


class CollectiveInit(_Request):
    """``POST /v1/collective/init``: every engine joins the trainer's NCCL group."""

    ip: str = Field(min_length=1, description="the trainer's rendezvous address (its rank 0)")
    port: int = Field(ge=1, le=65535)
    train_world_size: int = Field(ge=1, description="the trainer's ranks; the engines' come after")


class CollectivePrepare(_Request):
    """``POST /v1/collective/prepare``: names, shapes and dtypes of the tensors to come."""

    state_dict_info: dict[str, Any]


class CollectiveUpdate(_Request):
    """``POST /v1/collective/update``: receive the trainer's broadcast and serve it as ``version``."""

    version: str = Field(min_length=1, max_length=MAX_WEIGHTS_VERSION_CHARS)
    drain: bool = True
    recompute_kv: bool = False
    path: str | None = Field(None, min_length=1, description="a checkpoint of these weights, for late engines")


class IpcRefit(_Request):
    """``POST /v1/weights/ipc``: the colocated refit, by CUDA IPC handles of packed buffers."""

    version: str = Field(min_length=1, max_length=MAX_WEIGHTS_VERSION_CHARS)
    state_dict_info: dict[str, Any]
    buffers: list[IpcBuffer] = Field(min_length=1, description="the trainer's packed buffers, by CUDA IPC")
    path: str | None = Field(None, min_length=1, description="a checkpoint of these weights, for late engines")


# --- answers --------------------------------------------------------------------------------


class EngineOutcome(_Answer):
    """What one engine answered to one fan-out (``detail``: its status and reason when not ok)."""

    engine: str
    role: str
    replica: int
    url: str | None
    ok: bool
    detail: str
    elapsed_s: float


class PendingEngine(_Answer):
    """An engine the fan-out could not call (not ready)."""

    engine: str
    role: str
    replica: int


class FanOutReport(_Answer):
    """The answer of every fan-out route (200 when ``complete``, else 502)."""

    op: ControlOp
    complete: bool
    engines: int = Field(description="engines of the fleet: called + pending")
    ok: int
    failed: list[EngineOutcome]
    pending: list[PendingEngine]
    outcomes: list[EngineOutcome]
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
    path: str
    version: str


class FleetEngine(_Answer):
    """One engine in ``GET /v1/fleet``: ``weights_version`` as it answers now (None: no answer)."""

    engine: str
    role: str
    replica: int
    url: str | None
    ready: bool
    weights_version: str | None


class FleetReport(_Answer):
    """``GET /v1/fleet``: every engine with the version it serves, the desired and published weights."""

    desired: DesiredWeights | None
    published: str | None
    refitting: bool
    collective_group: GroupLayout | None
    engines: list[FleetEngine]
