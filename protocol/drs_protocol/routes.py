"""Route paths and operation names of the three HTTP APIs, defined once for both sides.

* The **serving API** every engine and every frontend answers (OpenAI-compatible turns, health,
  metrics) and the engine-only routes a peer or the operator calls (``/server_info``, the KV
  fetch a decode engine makes on a prefill engine).
* The **engine control API** (``/control/...``) the trainer sidecar calls on every engine, behind
  a bearer token. Each route performs one :class:`ControlOp`; the op's name is also its metric
  label, its report name in the sidecar and, where TensorRT-LLM has one, the worker method
  (NeMo RL's names: ``prepare_refit_info``, ``update_weights_from_collective`` …).
* The **trainer API** of the sidecar (``/v1/refit`` …), on localhost in the trainer's pod.

A test (``tests/protocol/test_contract_drift.py``) fails when non-test code spells one of these
paths itself instead of importing it from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final


class Endpoint(StrEnum):
    """The two OpenAI routes a turn is served on (engine and frontend alike)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


#: What an OpenAI client's ``base_url`` ends with (its requests go to ``base_url + "/chat/completions"``
#: …): every :class:`Endpoint` is below it. NeMo-Gym's ``base_url`` is a frontend URL plus this.
OPENAI_BASE_PATH: Final = "/v1"


#: 200 once the process serves (engine: once the model is loaded; frontend: liveness).
HEALTH: Final = "/health"
#: Frontend readiness: 200 while at least one prefill and one decode engine answer ``/health``.
READY: Final = "/ready"
#: Prometheus text (engine, frontend and sidecar).
METRICS: Final = "/metrics"
#: Liveness of the operator (kopf's endpoint, probed by the chart) and of the sidecar.
HEALTHZ: Final = "/healthz"
#: Engine: ``{"disaggregated_params", "max_batch_size", "tokens_per_block", …}``.
SERVER_INFO: Final = "/server_info"
#: Engine: the one model served.
MODELS: Final = "/v1/models"
#: Engine wider than a node: its leader's report of the gang (``drs_protocol.gang.GangReport``);
#: ranks above 0 answer it with their own view.
GANG: Final = "/v1/gang"
#: Engine (sim): a prefill engine hands a context state to a decode engine and forgets it.
KV_EXPORT: Final = "/v1/disagg/kv/{ctx_request_id}"
#: Query parameter of :data:`KV_EXPORT` (torch, ``?transport=cuda_ipc_arena``): the CUDA IPC handle
#: (base64) of an event the decode engine recorded after its copy out of the prefill engine's
#: handoff arena. The take is then sent while the copy runs, and the prefill engine reuses the
#: region only once that event has completed.
KV_COPY_EVENT_PARAM: Final = "copy_event"
#: Query parameter of :data:`KV_EXPORT` (torch, any ``?transport=``): ``1`` asks for the frame's
#: header to name the prompt by its digest (``prompt_digest``) instead of carrying its ids (at 16k
#: tokens 87 KB of base64 to encode, send and decode on a handoff's critical path); a prefill
#: engine that does not know it sends the ids, which the decode engine then compares instead.
KV_PROMPT_DIGEST_PARAM: Final = "prompt_digest"
#: Prefill engine: how many leading blocks of a prompt its prefix cache holds
#: (``drs_protocol.prefix_lookup``; a frontend asks it on a routing miss).
PREFIX_HELD: Final = "/v1/prefix_cache/held"


def kv_export_path(ctx_request_id: int) -> str:
    """:data:`KV_EXPORT` for one context request."""
    return KV_EXPORT.format(ctx_request_id=ctx_request_id)


class ControlOp(StrEnum):
    """One operation of the engine control API (route, metric label and report name)."""

    GET_WEIGHTS_VERSION = "get_weights_version"
    LOAD_WEIGHTS = "load_weights"
    INIT_COLLECTIVE = "init_collective"
    PREPARE_REFIT_INFO = "prepare_refit_info"
    UPDATE_WEIGHTS_FROM_COLLECTIVE = "update_weights_from_collective"
    UPDATE_WEIGHTS_FROM_IPC = "update_weights_from_ipc"
    ABORT_COLLECTIVE = "abort_collective"
    #: The sidecar names the weights the fleet is about to hold, before any load: an engine
    #: holding others refuses new legs (503 ``weights_pending``) until it holds them.
    ANNOUNCE_WEIGHTS_TARGET = "announce_weights_target"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    RELEASE_MEMORY = "release_memory"
    RESUME_MEMORY = "resume_memory"
    START_PROFILE = "start_profile"
    STOP_PROFILE = "stop_profile"


#: ``GET`` this path: the weights version an engine serves (:attr:`ControlOp.GET_WEIGHTS_VERSION`).
CONTROL_WEIGHTS: Final = "/control/weights"
#: ``GET`` this path: the weights an engine holds as one stream (:mod:`drs_protocol.weights_stream`),
#: for a peer catching up; behind the control token as every control route.
CONTROL_WEIGHTS_STREAM: Final = "/control/weights/stream"

#: The ``POST`` route of every other control operation.
CONTROL_ROUTES: Final[Mapping[ControlOp, str]] = MappingProxyType(
    {
        ControlOp.LOAD_WEIGHTS: "/control/weights/load",
        ControlOp.INIT_COLLECTIVE: "/control/collective/init",
        ControlOp.PREPARE_REFIT_INFO: "/control/collective/prepare",
        ControlOp.UPDATE_WEIGHTS_FROM_COLLECTIVE: "/control/collective/update",
        ControlOp.ABORT_COLLECTIVE: "/control/collective/abort",
        ControlOp.UPDATE_WEIGHTS_FROM_IPC: "/control/weights/ipc",
        ControlOp.ANNOUNCE_WEIGHTS_TARGET: "/control/weights/target",
        ControlOp.RESET_PREFIX_CACHE: "/control/prefix_cache/reset",
        ControlOp.RELEASE_MEMORY: "/control/memory/release",
        ControlOp.RESUME_MEMORY: "/control/memory/resume",
        ControlOp.START_PROFILE: "/control/profile/start",
        ControlOp.STOP_PROFILE: "/control/profile/stop",
    }
)


class TrainerRoute(StrEnum):
    """The trainer-facing API of ``drs sidecar`` (besides :data:`HEALTHZ` and :data:`METRICS`)."""

    REFIT = "/v1/refit"
    COLLECTIVE_INIT = "/v1/collective/init"
    COLLECTIVE_PREPARE = "/v1/collective/prepare"
    COLLECTIVE_UPDATE = "/v1/collective/update"
    IPC_UPDATE = "/v1/weights/ipc"
    PREFIX_CACHE_RESET = "/v1/prefix_cache/reset"
    SLEEP = "/v1/sleep"
    WAKE = "/v1/wake"
    PROFILE_START = "/v1/profile/start"
    PROFILE_STOP = "/v1/profile/stop"
    FLEET = "/v1/fleet"
