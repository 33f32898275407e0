"""The engine control API: refit, prefix-cache reset, sleep/wake and profiling, behind a bearer token.

Called by the trainer-side sidecar on every engine (never through a frontend). Every route needs
``Authorization: Bearer <token>``; the token comes from ``--control-token-file`` or the
environment (:data:`drs_protocol.env.CONTROL_TOKEN`). Paths and operation names are
:mod:`drs_protocol.routes`'s, bodies :mod:`drs_protocol.control`'s. No header → 401; a wrong
token → 403; an engine started without a token refuses the whole control API (403 saying so). Calls are serialised: one
``asyncio.Lock`` per server, so two overlapping updates run one after the other and both report.

==========================================  ==================================================  =====
route                                       body                                                notes
==========================================  ==================================================  =====
``GET  /control/weights``                   —                                                   the version served
``POST /control/weights/load``              ``{"path": str, "version": str}``                   sim: path must be a readable file/dir
``POST /control/collective/init``           ``{"rank_prefix", "ip", "port", "world_size",       trtllm only (sim: 501)
                                            "train_world_size"}``
``POST /control/collective/prepare``        ``{"state_dict_info": {...}}``                      trtllm only (sim: 501)
``POST /control/collective/update``         ``{"version": str, "drain": bool,                   trtllm only (sim: 501)
                                            "recompute_kv": bool}``
``POST /control/prefix_cache/reset``        ``{}`` or empty                                     empties the prefix cache
``POST /control/memory/release``            ``{"tags": [str, ...]}`` (empty: all)               sleep: serving gets 503
``POST /control/memory/resume``             ``{"tags": [str, ...]}`` (empty: all)               wake
``POST /control/profile/start``             ``{}`` or empty
``POST /control/profile/stop``              ``{}`` or empty
==========================================  ==================================================  =====

A successful call answers ``{"op", "result", "weights_version", "waited_s", "elapsed_s"}``
(``waited_s``: time spent queued behind other control calls). A failed call answers the OpenAI
error shape; a weights load that fails leaves the previous weights serving and says why.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

from drs_protocol import env, fields
from drs_protocol.body import parse_json_object, read_body
from drs_protocol.control import (
    CollectiveInit,
    CollectiveUpdate,
    IpcUpdate,
    LoadWeights,
    MemoryTags,
    PrepareRefitInfo,
)
from drs_protocol.limits import MAX_CONTROL_BODY_BYTES
from drs_protocol.routes import CONTROL_ROUTES, CONTROL_WEIGHTS, ControlOp
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from drs_engine.errors import EngineError, ForbiddenError, UnauthorizedError
from drs_engine.server.body import validate
from drs_engine.server.state import EngineState

Action = Callable[[Any], Awaitable[dict[str, Any]]]


def check_token(state: EngineState, request: Request) -> None:
    """401 without a bearer token, 403 with a wrong one or when the control API is disabled."""
    if not state.control_token:
        raise ForbiddenError(
            f"the control API is disabled on this engine: start it with --control-token-file or {env.CONTROL_TOKEN}"
        )
    presented = fields.bearer_token(request.headers.get(fields.CONTROL_AUTH_HEADER, ""))
    if presented is None:
        raise UnauthorizedError(f"the control API needs 'Authorization: {fields.CONTROL_AUTH_SCHEME} <token>'")
    if not hmac.compare_digest(presented.encode(), state.control_token.encode()):
        raise ForbiddenError("wrong control token")


async def _body(request: Request, model: type[BaseModel] | None) -> Any:
    raw = await read_body(request, MAX_CONTROL_BODY_BYTES)
    if model is None:  # no parameters: an empty body or any JSON object (checked, then ignored)
        if raw.strip():
            parse_json_object(raw)
        return None
    data = parse_json_object(raw) if raw.strip() else {}
    return validate(model, data)


async def run_op(
    state: EngineState,
    request: Request,
    op: ControlOp,
    model: type[BaseModel] | None,
    action: Action,
) -> Response:
    """Authenticate, parse, wait for the control lock, run ``action``, and report."""
    metrics = state.metrics
    try:
        check_token(state, request)
        params = await _body(request, model)
        state.require_backend()
        queued = time.monotonic()
        async with state.control_lock:
            started = time.monotonic()
            result = await action(params)
            done = time.monotonic()
    except EngineError as exc:
        if metrics is not None:
            metrics.control_ops.labels(op=op.value, status="error").inc()
        return _error(exc)
    backend = state.require_backend()
    if metrics is not None:
        metrics.control_ops.labels(op=op.value, status="ok").inc()
    return JSONResponse(
        {
            "op": op.value,
            "result": result,
            "weights_version": backend.weights_version,
            "waited_s": round(started - queued, 6),
            "elapsed_s": round(done - started, 6),
        }
    )


def _error(exc: EngineError) -> Response:
    challenge = {fields.CONTROL_AUTH_CHALLENGE_HEADER: fields.CONTROL_AUTH_SCHEME}
    headers = challenge if isinstance(exc, UnauthorizedError) else None
    return JSONResponse(exc.to_body(), status_code=exc.status, headers=headers)


def register(app: Any, state: EngineState) -> None:
    """Add the control routes to ``app`` (a FastAPI/Starlette app)."""

    def backend_op(op: ControlOp) -> Action:
        async def call(params: Any) -> dict[str, Any]:
            method: Callable[..., Awaitable[dict[str, Any]]] = getattr(state.require_backend(), op.value)
            return await (method() if params is None else method(params))

        return call

    async def get_weights(request: Request) -> Response:
        try:
            check_token(state, request)
            backend = state.require_backend()
        except EngineError as exc:
            return _error(exc)
        return JSONResponse(
            {"weights_version": backend.weights_version, "backend": backend.name, "test_double": backend.test_double}
        )

    async def load(params: LoadWeights) -> dict[str, Any]:
        result = await state.require_backend().load_weights(params.path, params.version)
        state.require_metrics().set_weights_version(params.version, loaded=True)
        return result

    async def update(params: CollectiveUpdate) -> dict[str, Any]:
        result = await state.require_backend().update_weights_from_collective(params)
        state.require_metrics().set_weights_version(params.version, loaded=True)
        return result

    async def update_ipc(params: IpcUpdate) -> dict[str, Any]:
        result = await state.require_backend().update_weights_from_ipc(params)
        state.require_metrics().set_weights_version(params.version, loaded=True)
        return result

    async def release(params: MemoryTags) -> dict[str, Any]:
        result = await state.require_backend().release_memory(params.tags)
        state.released_tags.update(result.get("released", params.tags))
        state.require_metrics().asleep.set(1 if state.released_tags else 0)
        return result

    async def resume(params: MemoryTags) -> dict[str, Any]:
        result = await state.require_backend().resume_memory(params.tags)
        state.released_tags.difference_update(result.get("resumed", params.tags))
        state.require_metrics().asleep.set(1 if state.released_tags else 0)
        return result

    ops: dict[ControlOp, tuple[type[BaseModel] | None, Action]] = {
        ControlOp.LOAD_WEIGHTS: (LoadWeights, load),
        ControlOp.INIT_COLLECTIVE: (CollectiveInit, backend_op(ControlOp.INIT_COLLECTIVE)),
        ControlOp.PREPARE_REFIT_INFO: (PrepareRefitInfo, backend_op(ControlOp.PREPARE_REFIT_INFO)),
        ControlOp.UPDATE_WEIGHTS_FROM_COLLECTIVE: (CollectiveUpdate, update),
        ControlOp.UPDATE_WEIGHTS_FROM_IPC: (IpcUpdate, update_ipc),
        ControlOp.RESET_PREFIX_CACHE: (None, backend_op(ControlOp.RESET_PREFIX_CACHE)),
        ControlOp.RELEASE_MEMORY: (MemoryTags, release),
        ControlOp.RESUME_MEMORY: (MemoryTags, resume),
        ControlOp.START_PROFILE: (None, backend_op(ControlOp.START_PROFILE)),
        ControlOp.STOP_PROFILE: (None, backend_op(ControlOp.STOP_PROFILE)),
    }
    for op, path in CONTROL_ROUTES.items():
        model, action = ops[op]
        app.add_api_route(path, _endpoint(state, op, model, action), methods=["POST"], name=op.value)
    app.add_api_route(CONTROL_WEIGHTS, get_weights, methods=["GET"], name=ControlOp.GET_WEIGHTS_VERSION.value)


def _endpoint(
    state: EngineState, op: ControlOp, model: type[BaseModel] | None, action: Action
) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await run_op(state, request, op, model, action)

    endpoint.__name__ = op.value
    return endpoint
