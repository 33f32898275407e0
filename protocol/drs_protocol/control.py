"""The engine control API typed both ways: request bodies (the sidecar builds them, the engine
validates them) and answers (the engine returns them, the sidecar parses them).

Routes and operation names: :mod:`drs_protocol.routes` (:class:`~drs_protocol.routes.ControlOp`).
:data:`OPS` is the one table of each ``POST`` operation's request model (None: no parameters) and
result model; every successful ``POST`` answers a :class:`ControlAnswer` of that result, and
``GET /control/weights`` a :class:`WeightsInfo`. A result's ``figures`` are a backend's own
measurements (seconds, bytes, GPU memory …): JSON scalars by name, never read by a decision.
"""

from __future__ import annotations

import functools
from enum import StrEnum
from typing import Annotated, Any, Final, Generic, TypeVar, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from drs_protocol.limits import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    MAX_COLLECTIVE_TIMEOUT_S,
    MAX_WEIGHTS_TARGET_LEASE_S,
    MAX_WEIGHTS_VERSION_CHARS,
)
from drs_protocol.routes import ControlOp
from drs_protocol.weights_digest import DIGEST_PATTERN


def _printable(value: str) -> str:
    if value != value.strip() or not value.isprintable():
        raise ValueError("must be printable, with no leading or trailing whitespace")
    return value


#: A weights version, the one rule wherever one is given (the engine's control API, the sidecar's
#: trainer API, the annotations the operator reads): 1 to
#: :data:`~drs_protocol.limits.MAX_WEIGHTS_VERSION_CHARS` characters, printable, no surrounding
#: whitespace.
Version = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_WEIGHTS_VERSION_CHARS), AfterValidator(_printable)
]
#: A weights digest (:mod:`drs_protocol.weights_digest`): ``wd1:`` and 64 lower-case hex digits.
Digest = Annotated[str, StringConstraints(pattern=DIGEST_PATTERN)]


#: NeMo RL's ``state_dict_info``: each tensor's name -> ``[shape, dtype]`` (a dtype name such as
#: ``bfloat16`` or ``torch.bfloat16``), in the order the trainer packs them; the engine checks the
#: names, shapes and dtypes against its model (:func:`drs_protocol.nemo_rl_refit.parse_state_dict_info`).
StateDictInfo = dict[str, tuple[list[int], str]]

#: A backend's measurement: a JSON scalar.
Figure = int | float | str | bool | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _LoadPath(_Strict):
    path: str = Field(min_length=1)
    version: Version


class LoadAnnounce(_Strict):
    """The target announced by the load that brings it (the announce folded into the load: one
    call per engine): the engine takes ``WeightsTarget(version=the load's version, digest, lease_s,
    effective_at=the load's effective_at)`` the moment the call arrives, before it waits for the
    control lock or reads anything, exactly as ``POST /control/weights/target`` would."""

    digest: Digest | None = None
    lease_s: float = Field(gt=0, le=MAX_WEIGHTS_TARGET_LEASE_S, description="seconds the target binds the engine")


class LoadWeights(_LoadPath):
    """Load weights from a path (a checkpoint directory or file) and serve them as ``version``.
    ``effective_at``: the refit's cut-over (wall clock, epoch seconds, :mod:`drs_protocol.cutover`):
    the engine may read and check the new weights before it, into a copy that serves nothing, and
    serves them from that instant on its own clock (None: at once); at most
    :data:`~drs_protocol.cutover.MAX_SWITCH_AHEAD_S` ahead of the engine's clock. The read overlaps
    the margin instead of following it. ``announce``: the load also announces its target (the
    engine refuses legs stamped from ``effective_at`` on until it holds them), so the sidecar needs
    no announce round first; the answer's ``told_lead_s`` says how early it came."""

    effective_at: float | None = Field(
        None, gt=0, allow_inf_nan=False, description="serve the new weights from this instant, epoch seconds"
    )
    announce: LoadAnnounce | None = None

    def target(self) -> WeightsTarget | None:
        """The announce this load carries, as its own call would send it (None: none)."""
        if self.announce is None:
            return None
        return WeightsTarget(
            version=self.version,
            digest=self.announce.digest,
            lease_s=self.announce.lease_s,
            effective_at=self.effective_at,
        )


class Refit(_LoadPath):
    """The trainer's ``POST /v1/refit`` to the sidecar: every engine loads ``path`` as ``version``."""

    digest: Digest | None = Field(
        None,
        description="drs_protocol.weights_digest of the checkpoint's weights (the trainer computes it): an engine "
        "whose digest differs after the load has failed; without it, the engines must agree",
    )


class TrainerCollectiveInit(_Strict):
    """The trainer's ``POST /v1/collective/init`` to the sidecar: where its group's store is and how
    many ranks it holds (the engines' ranks come after, in status order)."""

    ip: str = Field(min_length=1, description="the trainer's rendezvous address (its rank 0)")
    port: int = Field(ge=1, le=65535)
    train_world_size: int = Field(ge=1, description="the trainer's ranks; the engines' come after")


class _Deadline(_Strict):
    """How long one collective step may take on the engine (the sidecar's
    ``--collective-timeout`` share for the engines, :mod:`drs_sidecar.group_abort`)."""

    timeout_s: float = Field(
        DEFAULT_COLLECTIVE_TIMEOUT_S,
        gt=0,
        le=MAX_COLLECTIVE_TIMEOUT_S,
        description="seconds the step may wait for the group's other ranks; past it the engine answers 502",
    )


class CollectiveInit(TrainerCollectiveInit, _Deadline):
    """NeMo RL's ``init_collective`` (the sidecar to one engine): join the trainer's group at
    ``train_world_size + rank_prefix``; the group holds ``world_size`` ranks. ``timeout_s`` bounds
    the join and is the group's timeout for its operations."""

    rank_prefix: int = Field(ge=0)
    world_size: int = Field(ge=1)


class PrepareRefitInfo(_Strict):
    """NeMo RL's ``prepare_refit_info``: names, shapes and dtypes of the tensors to come."""

    state_dict_info: StateDictInfo


class _UpdateFields(_Strict):
    version: Version
    drain: bool = True
    recompute_kv: bool = False


class CollectiveUpdate(_UpdateFields, _Deadline):
    """NeMo RL's ``update_weights_from_collective``, then serve the result as ``version``;
    ``timeout_s`` bounds the whole update (every batch's broadcast)."""


class CollectiveAbort(_Strict):
    """Leave the collective group now (the sidecar, after a member of it failed): the group is
    dropped, so a later step needs a new ``init_collective``; an update in flight fails by its own
    deadline at the latest."""

    reason: str = Field(min_length=1, max_length=4096, description="why the group is aborted (logged)")


class _Desired(_Strict):
    """What a trainer adds to an update sent to the sidecar: where engines that come later get the
    same weights, and their digest."""

    path: str | None = Field(None, min_length=1, description="a checkpoint of these weights, for late engines")
    digest: Digest | None = Field(
        None,
        description="drs_protocol.weights_digest of the weights sent (the trainer computes it): an engine whose "
        "digest differs after the update has failed; without it, the engines must agree",
    )


class TrainerCollectiveUpdate(_UpdateFields, _Desired):
    """The trainer's ``POST /v1/collective/update`` to the sidecar."""


class CudaIpcHandle(_Strict):
    """A CUDA tensor as another process on the same host maps it: torch's ``reduce_tensor`` fields
    in plain JSON (base64 handles, ints; never a pickle), as the engine's
    ``backends.torch.ipc.ipc_export`` writes them."""

    size: list[int]
    stride: list[int]
    offset: int = Field(ge=0)
    device: int = Field(ge=0)
    handle: str = Field(min_length=1)
    storage_size_bytes: int = Field(ge=0)
    storage_offset_bytes: int = Field(ge=0)
    ref_counter_handle: str | None
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool


class IpcBuffer(_Strict):
    """One packed weights buffer a colocated trainer shares by CUDA IPC: ``nbytes`` bytes of the
    packed layout (:mod:`drs_protocol.nemo_rl_refit`) from byte ``offset`` on, on the GPU
    ``gpu_uuid``. ``ipc``: the CUDA IPC fields of the buffer (handle, sizes, reference counter,
    event; plain base64/ints, never a pickle), as the engine's ``backends.torch.ipc.ipc_export`` writes them."""

    gpu_uuid: str = Field(min_length=1)
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    ipc: CudaIpcHandle


class IpcUpdate(_Strict):
    """The colocated refit (NeMo RL's colocated path: the trainer on the engines' GPUs shares its
    packed weight buffers by CUDA IPC handles): copy the tensors of ``state_dict_info``, packed in
    that order with no padding, out of ``buffers`` into the engine's weights; serve them as
    ``version``. The trainer keeps the buffers alive and unchanged until the call returns."""

    version: Version
    state_dict_info: StateDictInfo
    buffers: list[IpcBuffer] = Field(min_length=1)


class TrainerIpcUpdate(IpcUpdate, _Desired):
    """The trainer's ``POST /v1/weights/ipc`` to the sidecar."""


class MemoryTags(_Strict):
    """Memory to release (sleep) or resume (wake); empty means every tag (TensorRT-LLM's tags:
    ``model``, ``kv_cache``, ``sampler``, ``drafter``, … — any string is accepted)."""

    tags: list[str] = Field(default_factory=list)


class WeightsTarget(_Strict):
    """``POST /control/weights/target``: the weights the fleet is about to hold, announced by the
    sidecar before any load. While the engine holds others (by digest when both sides know one,
    else by version) it refuses new legs (503 ``weights_pending``), for at most ``lease_s`` seconds
    after this announce unless announced again. ``version`` None withdraws the target.
    ``effective_at``: the cut-over (wall clock, epoch seconds, :mod:`drs_protocol.cutover`): only
    legs of turns stamped at or after it are refused, earlier ones are served with what the engine
    holds (None: every new leg, as before)."""

    version: Version | None
    digest: Digest | None = None
    lease_s: float = Field(gt=0, le=MAX_WEIGHTS_TARGET_LEASE_S, description="seconds the target binds the engine")
    effective_at: float | None = Field(None, gt=0, allow_inf_nan=False, description="the cut-over, epoch seconds")


# -- answers ---------------------------------------------------------------------------------


class CatchUpPhase(StrEnum):
    """Where an engine is on its way to the desired weights it started under."""

    #: loading them (from the path or a peer), or waiting to try again: not ready
    PENDING = "pending"
    #: it holds them (or a weights operation moved it on since)
    REACHED = "reached"


class CatchUpStatus(_Strict):
    """``WeightsInfo.catch_up``: the desired weights the engine started under and how far it is
    (:mod:`drs_protocol.weights_stream`). ``source``: the checkpoint path, or ``peers``;
    ``last_error``: the last attempt's failure, naming the path, peer or digests;
    ``next_attempt_s``: seconds until the next try (None: one runs now, or none is due)."""

    phase: CatchUpPhase
    desired_version: str
    desired_digest: Digest | None = None
    source: str
    attempts: int = Field(ge=0)
    last_error: str | None = None
    next_attempt_s: float | None = None
    reached_from: str | None = None


class TargetState(_Strict):
    """The announced target weights as one engine sees them: ``held`` (it holds them: new legs
    are admitted) and the seconds its lease has left."""

    version: str
    digest: Digest | None = None
    held: bool
    expires_in_s: float
    effective_at: float | None = None


class WeightsInfo(_Strict):
    """``GET /control/weights``: the weights the engine holds, as the engine itself observes them.
    ``weights_digest``: :mod:`drs_protocol.weights_digest` of the bytes it holds, computed by the
    engine after every change of its weights (None: its backend computes none). ``catch_up``: an
    engine started under desired weights it did not hold says how far it is (None: it started
    under none, or at them). ``target``: the announced target while its lease runs (None: none,
    new legs are admitted)."""

    weights_version: str
    weights_digest: Digest | None
    backend: str
    test_double: bool
    catch_up: CatchUpStatus | None = None
    target: TargetState | None = None


class _Result(_Strict):
    figures: dict[str, Figure] = Field(default_factory=dict)


class WeightsChanged(_Result):
    """A load, collective update or CUDA IPC update: the engine now serves ``version``. A load
    that carried its announce (``LoadWeights.announce``) says ``told_lead_s``, the seconds from
    taking the target to its cut-over on the engine's clock (negative: told late), and
    ``late_legs`` as :class:`TargetAnnounced` does."""

    version: str
    previous_version: str
    prefix_cache_blocks_evicted: int | None = None
    told_lead_s: float | None = Field(None, allow_inf_nan=False)
    late_legs: int = Field(0, ge=0)


class TargetAnnounced(_Result):
    """The engine took the announce: ``target`` as it now stands (None: withdrawn). ``late_legs``:
    legs of turns stamped at or after the target's cut-over that this engine had already answered
    at other weights when the announce arrived (it came after its cut-over; counted in
    ``drs_engine_late_target_legs_total``)."""

    target: TargetState | None = None
    late_legs: int = Field(0, ge=0)


class CollectiveJoined(_Result):
    world_size: int
    rank: int | None = None  #: this engine's first rank (None: the backend does not say)


class CollectiveAborted(_Result):
    """``aborted``: a group was there and is gone; ``weights_incomplete``: the engine holds bytes of
    an update that did not finish, and answers turns with 503 until a good load."""

    aborted: bool
    weights_incomplete: bool = False


class RefitPrepared(_Result):
    tensors: int


class CacheReset(_Result):
    prefix_cache_blocks_evicted: int | None = None


class MemoryReleased(_Result):
    released: list[str]
    prefix_cache_blocks_evicted: int | None = None
    context_states_dropped: int | None = None
    gpu_allocated_bytes: int | None = None  #: what the engine still holds on its GPU (torch)


class MemoryResumed(_Result):
    resumed: list[str]
    gpu_allocated_bytes: int | None = None  #: what the engine holds on its GPU again (torch)


class Profiling(_Result):
    profiling: bool
    duration_s: float | None = None


ResultT = TypeVar("ResultT", bound=_Result)


class ControlAnswer(_Strict, Generic[ResultT]):
    """A successful ``POST`` of the control API. ``weights_version`` and ``weights_digest``: what
    the engine holds after the operation; ``waited_s``: queued behind other control calls. The
    engine writes it without the fields at their defaults (an empty ``figures``, a None
    ``duration_s`` …), as :func:`answer_json` does."""

    op: ControlOp
    result: ResultT
    weights_version: str
    weights_digest: Digest | None
    waited_s: float
    elapsed_s: float


#: Each operation's request model (None: no parameters; any JSON object is accepted and ignored)
#: and result model.
OPS: Final[dict[ControlOp, tuple[type[BaseModel] | None, type[_Result]]]] = {
    ControlOp.LOAD_WEIGHTS: (LoadWeights, WeightsChanged),
    ControlOp.INIT_COLLECTIVE: (CollectiveInit, CollectiveJoined),
    ControlOp.PREPARE_REFIT_INFO: (PrepareRefitInfo, RefitPrepared),
    ControlOp.UPDATE_WEIGHTS_FROM_COLLECTIVE: (CollectiveUpdate, WeightsChanged),
    ControlOp.UPDATE_WEIGHTS_FROM_IPC: (IpcUpdate, WeightsChanged),
    ControlOp.ABORT_COLLECTIVE: (CollectiveAbort, CollectiveAborted),
    ControlOp.ANNOUNCE_WEIGHTS_TARGET: (WeightsTarget, TargetAnnounced),
    ControlOp.RESET_PREFIX_CACHE: (None, CacheReset),
    ControlOp.RELEASE_MEMORY: (MemoryTags, MemoryReleased),
    ControlOp.RESUME_MEMORY: (MemoryTags, MemoryResumed),
    ControlOp.START_PROFILE: (None, Profiling),
    ControlOp.STOP_PROFILE: (None, Profiling),
}


@functools.cache
def answer_model(op: ControlOp) -> type[ControlAnswer[Any]]:
    """The answer model of ``op``: a :class:`ControlAnswer` of its result model (:data:`OPS`)."""
    generic: Any = ControlAnswer
    return cast("type[ControlAnswer[Any]]", generic[OPS[op][1]])


def answer_json(answer: BaseModel) -> dict[str, Any]:
    """An answer as the engine writes it: JSON, fields at their defaults left out."""
    return answer.model_dump(mode="json", exclude_defaults=True)


def answer_bytes(answer: BaseModel) -> bytes:
    """:func:`answer_json`, encoded: the body the engine sends (one pass of pydantic's encoder,
    no dict in between: 256 engines in one process answer a refit within the same instant)."""
    return answer.model_dump_json(exclude_defaults=True).encode()


def result_of(model: type[ResultT], raw: dict[str, Any]) -> ResultT:
    """A backend's report as ``model``: its named fields, every other JSON scalar into
    ``figures`` (anything else: ``ValueError``, the backend broke the contract)."""
    named = {k: v for k, v in raw.items() if k in model.model_fields and k != "figures"}
    figures = {k: v for k, v in raw.items() if k not in named}
    bad = sorted(k for k, v in figures.items() if v is not None and not isinstance(v, int | float | str | bool))
    if bad:
        raise ValueError(f"{model.__name__}: not JSON scalars: {', '.join(bad)}")
    return model.model_validate({**named, "figures": figures})
