"""The engine control API: refit, prefix-cache reset, sleep/wake and profiling, behind a bearer token.

Called by the trainer-side sidecar on every engine (never through a frontend). Every route needs
``Authorization: Bearer <token>``; the token comes from ``--control-token-file`` or the
environment (:data:`drs_protocol.env.CONTROL_TOKEN`). Paths and operation names are
:mod:`drs_protocol.routes`'s; request and answer models :mod:`drs_protocol.control`'s
(:data:`~drs_protocol.control.OPS`). No header or a wrong token → 401 (``drs_protocol.auth``;
the app's middleware, :mod:`.auth`, answers it before the route; :func:`check_token` inside it
compares the token again only where that middleware did not accept it, e.g. a route registered
outside the app); an engine started without a token refuses the whole control API (403 saying so).
A body is parsed and validated in one pass (``model_validate_json``); one that pass refuses is
parsed by ``json`` and validated again, so its 400 is the one it always was, naming the field. Calls are serialised: one
``asyncio.Lock`` per server, so two overlapping updates run one after the other and both report.

==========================================  ==================================================  =====
route                                       body                                                notes
==========================================  ==================================================  =====
``GET  /control/weights``                   —                                                   version, digest, catch-up
``GET  /control/weights/stream``            —                                                   the weights, to a peer
``POST /control/weights/load``              ``{"path": str, "version": str,                     sim: path must be a readable file/dir;
                                            "effective_at": float | null,                       at the cut-over: read first, swap then;
                                            "announce": {"digest", "lease_s"} | null}``         announce: taken on arrival
``POST /control/collective/init``           ``{"rank_prefix", "ip", "port", "world_size",       trtllm, torch (sim: 501)
                                            "train_world_size"}``
``POST /control/collective/prepare``        ``{"state_dict_info": {...}}``                      trtllm, torch (sim: 501)
``POST /control/collective/update``         ``{"version": str, "drain": bool,                   trtllm, torch (sim: 501)
                                            "recompute_kv": bool}``
``POST /control/collective/abort``          ``{"reason": str}``                                 not queued: beside an update
``POST /control/weights/ipc``               ``{"version", "state_dict_info", "buffers"}``       torch only
``POST /control/weights/target``            ``{"version", "digest", "lease_s",                  announce; never queued
                                            "effective_at"}``
``POST /control/prefix_cache/reset``        ``{}`` or empty                                     empties the prefix cache
``POST /control/memory/release``            ``{"tags": [str, ...]}`` (empty: all)               sleep: serving gets 503
``POST /control/memory/resume``             ``{"tags": [str, ...]}`` (empty: all)               wake
``POST /control/profile/start``             ``{}`` or empty
``POST /control/profile/stop``              ``{}`` or empty
==========================================  ==================================================  =====

A successful call answers a :class:`~drs_protocol.control.ControlAnswer` (``op``, ``result`` of
the op's result model, ``weights_version``, ``weights_digest``, ``waited_s``: time queued behind
other control calls, ``elapsed_s``); ``GET /control/weights`` a
:class:`~drs_protocol.control.WeightsInfo`. After every operation that changes the weights the
engine measures their digest from the bytes it holds (the backend's ``measure_digest``). A
failed call answers the OpenAI error shape; a weights load that fails leaves the previous weights
serving and says why; one that fails after it changed bytes leaves the engine refusing turns until a
load completes (:mod:`drs_engine.weights.incomplete`).

Two calls do not wait for the control lock: ``collective/abort`` must reach the group while an
update holds the lock, and ``POST /control/weights/target`` (:mod:`drs_engine.weights.target`)
announces the target weights before the sidecar loads any engine (an announce queued behind a load
would come after it). A load that carries its announce (``LoadWeights.announce``: one call per
engine) takes it on arrival, before it queues for the lock, and answers ``told_lead_s``.

The routes are registered on the app's router as plain Starlette routes, and a call whose exact
path and method are one of them is answered ahead of the app's middleware stack and router
(:class:`ControlDispatch`), behind the same 500 handler and token check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from drs_protocol import auth
from drs_protocol.auth import Realm
from drs_protocol.body import parse_json_object
from drs_protocol.control import (
    OPS,
    CollectiveAbort,
    CollectiveInit,
    CollectiveUpdate,
    ControlAnswer,
    IpcUpdate,
    LoadWeights,
    MemoryTags,
    PrepareRefitInfo,
    WeightsInfo,
    WeightsTarget,
    answer_bytes,
    result_of,
)
from drs_protocol.cutover import MAX_SWITCH_AHEAD_S
from drs_protocol.errors import ApiError
from drs_protocol.fastapi_errors import api_error_response
from drs_protocol.limits import MAX_CONTROL_BODY_BYTES
from drs_protocol.routes import CONTROL_ROUTES, CONTROL_WEIGHTS, ControlOp
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from drs_engine.backends.base import EngineBackend
from drs_engine.errors import EngineError, UnauthorizedError, WeightsLoadError
from drs_engine.metrics import CONTROL_ERROR, CONTROL_OK
from drs_engine.server.auth import check_control
from drs_engine.server.body import read_whole_body, validate
from drs_engine.server.state import EngineState
from drs_engine.weights import incomplete

log = logging.getLogger(__name__)

#: An operation's handler: its parsed request (None for an op without parameters) -> the backend's report.
Handler = Callable[[Any], Awaitable[dict[str, Any]]]
#: The operations that change the weights: the engine measures their digest afterwards.
WEIGHTS_OPS = frozenset(
    {ControlOp.LOAD_WEIGHTS, ControlOp.UPDATE_WEIGHTS_FROM_COLLECTIVE, ControlOp.UPDATE_WEIGHTS_FROM_IPC}
)
#: The answer model of every op (its result already validated by ``result_of``), made once:
#: parametrising a pydantic generic per call cost about as much as the rest of an announce.
_ANSWER: Final = ControlAnswer[Any]
#: The operations that do not wait for the control lock (an abort reaches an update in flight; an
#: announce must come before the loads).
UNLOCKED_OPS = frozenset({ControlOp.ABORT_COLLECTIVE, ControlOp.ANNOUNCE_WEIGHTS_TARGET})


def check_token(state: EngineState, request: Request) -> None:
    """Every control route's check (``drs_engine.server.auth.check_control``): 403 when the control
    API is disabled, 401 without the control token or with a wrong one."""
    check_control(state, request)


async def _body(request: Request, model: type[BaseModel] | None) -> Any:
    raw = await read_whole_body(request, MAX_CONTROL_BODY_BYTES)
    if model is None:  # no parameters: an empty body or any JSON object (checked, then ignored)
        if raw.strip():
            parse_json_object(raw)
        return None
    if not raw.strip():
        return validate(model, {})
    try:  # one pass of pydantic's JSON parser and validator (a body the refit sends every engine)
        return model.model_validate_json(raw)
    except ValidationError:
        pass  # the answer is the one it always was: parsed by json, then validated, naming the field
    return validate(model, parse_json_object(raw))


async def run_op(state: EngineState, request: Request, op: ControlOp, handler: Handler) -> Response:
    """Authenticate, parse, wait for the control lock, run ``handler``, measure the digest after a
    change of weights, and answer the op's :class:`ControlAnswer`."""
    metrics = state.metrics
    request_model, result_model = OPS[op]
    try:
        check_token(state, request)
        params = await _body(request, request_model)
        backend = state.require_backend()
        # a load carrying its announce binds the gate now, before it queues behind another call
        told = take_announce(state, params) if isinstance(params, LoadWeights) else None
        queued = time.monotonic()
        async with contextlib.nullcontext() if op in UNLOCKED_OPS else state.control_lock:
            started = time.monotonic()
            before, failure = state.weights_digest, None
            try:
                raw = await handler(params)
                if told is not None:
                    raw = {**raw, **told}
            except BaseException as exc:
                failure = exc
                raise
            finally:
                if op in WEIGHTS_OPS:  # even a failed update may have changed bytes in place
                    state.weights_digest = await _measure(backend)
                    incomplete.settle(state, failure, before, state.weights_digest)
            done = time.monotonic()
            if op in WEIGHTS_OPS:  # the sidecar's word is newer than the desired weights the pod started under
                state.weights_changed(backend.weights_version)
        try:
            result = result_of(result_model, raw)
        except (ValueError, ValidationError) as exc:
            raise EngineError(f"{op.value}: the {backend.name} backend's report breaks the contract: {exc}") from exc
    except EngineError as exc:
        if metrics is not None:
            metrics.count_control_op(op.value, CONTROL_ERROR)
        return _error(exc)
    if metrics is not None:
        metrics.count_control_op(op.value, CONTROL_OK)
    answer = _ANSWER(
        op=op,
        result=result,
        weights_version=backend.weights_version,
        weights_digest=state.weights_digest,
        waited_s=round(started - queued, 6),
        elapsed_s=round(done - started, 6),
    )
    return _answer(answer)


async def _measure(backend: EngineBackend) -> str | None:
    """The backend's digest now; None (unknown) when measuring fails, which never hides the
    operation's own outcome."""
    try:
        return await backend.measure_digest()
    except EngineError as exc:
        log.error("the weights digest could not be measured: %s", exc)
        return None


class _JsonAnswer(Response):
    """A 200 ``application/json`` answer with its two headers written directly: what Starlette's
    ``Response(body, media_type="application/json")`` sends (``content-length``, then
    ``content-type``, no charset), without assembling them per call."""

    media_type = "application/json"

    def __init__(self, body: bytes) -> None:
        self.status_code = 200
        self.body = body
        self.background = None
        self.raw_headers = [(b"content-length", str(len(body)).encode("latin-1")), (b"content-type", _JSON_TYPE)]


_JSON_TYPE: Final = b"application/json"


def _answer(answer: BaseModel) -> Response:
    return _JsonAnswer(answer_bytes(answer))


def _error(exc: EngineError) -> Response:
    headers = auth.challenge(Realm.CONTROL) if isinstance(exc, UnauthorizedError) else None
    return JSONResponse(exc.to_body(), status_code=exc.status, headers=headers)


def cut_over(effective_at: float, wall: Callable[[], float] = time.time) -> Callable[[], Awaitable[None]]:
    """A load's wait for its cut-over (``LoadWeights.effective_at``), on this engine's clock:
    :class:`WeightsLoadError` naming the field, before anything is read, when it is more than
    :data:`~drs_protocol.cutover.MAX_SWITCH_AHEAD_S` ahead."""
    ahead = effective_at - wall()
    if ahead > MAX_SWITCH_AHEAD_S:
        raise WeightsLoadError(
            f"effective_at: must be at most {MAX_SWITCH_AHEAD_S:g}s ahead of this engine's clock "
            f"(a refit's cut-over margin plus clock skew), got {ahead:.1f}s ahead",
            param="effective_at",
        )

    async def wait() -> None:
        # waiting for the scheduled instant itself (the cut-over), not standing in for an event
        await asyncio.sleep(max(0.0, effective_at - wall()))

    return wait


def announce_target(state: EngineState, target: WeightsTarget) -> int:
    """Take ``target`` (an announce, or a load's folded one): the legs already answered at other
    weights after its cut-over (a late announce), counted and logged."""
    backend = state.require_backend()
    late = state.target.announce(target, backend.weights_version, state.weights_digest)
    state.count_late_legs(late, f"{late} leg(s) already answered at weights {backend.weights_version}")
    return late


def take_announce(state: EngineState, params: LoadWeights) -> dict[str, Any] | None:
    """The announce a load carries (``LoadWeights.announce``), taken on arrival: its ``told_lead_s``
    (seconds left until the cut-over, this engine's clock) and ``late_legs`` for the load's answer.
    A cut-over too far ahead is refused (:func:`cut_over`) before the target binds anything."""
    target = params.target()
    if target is None:
        return None
    lead = None
    if params.effective_at is not None:
        cut_over(params.effective_at, state.target.wall)
        lead = round(params.effective_at - state.target.wall(), 6)
    return {"told_lead_s": lead, "late_legs": announce_target(state, target)}


def weights_info(state: EngineState) -> WeightsInfo:
    backend = state.require_backend()
    return WeightsInfo(
        weights_version=backend.weights_version,
        weights_digest=state.weights_digest,
        backend=backend.name,
        test_double=backend.test_double,
        catch_up=None if state.catch_up is None else state.catch_up.status(),
        target=state.target.state(backend.weights_version, state.weights_digest),
    )


def handlers(state: EngineState) -> dict[ControlOp, Handler]:
    """The op -> handler table (every :class:`ControlOp` with a route has one)."""

    async def load(params: LoadWeights) -> dict[str, Any]:
        backend = state.require_backend()
        if params.effective_at is None:
            result = await backend.load_weights(params.path, params.version)
        else:
            result = await backend.load_weights_at(params.path, params.version, cut_over(params.effective_at))
        state.require_metrics().set_weights_version(params.version, loaded=True)
        return result

    async def announce(params: WeightsTarget) -> dict[str, Any]:
        backend = state.require_backend()
        late = announce_target(state, params)
        return {"target": state.target.state(backend.weights_version, state.weights_digest), "late_legs": late}

    async def init_collective(params: CollectiveInit) -> dict[str, Any]:
        return await state.require_backend().init_collective(params)

    async def prepare(params: PrepareRefitInfo) -> dict[str, Any]:
        return await state.require_backend().prepare_refit_info(params)

    async def update(params: CollectiveUpdate) -> dict[str, Any]:
        result = await state.require_backend().update_weights_from_collective(params)
        state.require_metrics().set_weights_version(params.version, loaded=True)
        return result

    async def abort_collective(params: CollectiveAbort) -> dict[str, Any]:
        log.warning("the collective group is aborted: %s", params.reason)
        result = await state.require_backend().abort_collective(params.reason)
        return {**result, "weights_incomplete": state.weights_incomplete is not None}

    async def update_ipc(params: IpcUpdate) -> dict[str, Any]:
        result = await state.require_backend().update_weights_from_ipc(params)
        state.require_metrics().set_weights_version(params.version, loaded=True)
        return result

    async def reset(_: None) -> dict[str, Any]:
        return await state.require_backend().reset_prefix_cache()

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

    async def start_profile(_: None) -> dict[str, Any]:
        return await state.require_backend().start_profile()

    async def stop_profile(_: None) -> dict[str, Any]:
        return await state.require_backend().stop_profile()

    return {
        ControlOp.LOAD_WEIGHTS: load,
        ControlOp.ANNOUNCE_WEIGHTS_TARGET: announce,
        ControlOp.INIT_COLLECTIVE: init_collective,
        ControlOp.PREPARE_REFIT_INFO: prepare,
        ControlOp.UPDATE_WEIGHTS_FROM_COLLECTIVE: update,
        ControlOp.UPDATE_WEIGHTS_FROM_IPC: update_ipc,
        ControlOp.ABORT_COLLECTIVE: abort_collective,
        ControlOp.RESET_PREFIX_CACHE: reset,
        ControlOp.RELEASE_MEMORY: release,
        ControlOp.RESUME_MEMORY: resume,
        ControlOp.START_PROFILE: start_profile,
        ControlOp.STOP_PROFILE: stop_profile,
    }


#: A control route's endpoint: the request -> its answer.
Endpoint = Callable[[Request], Awaitable[Response]]


def register(app: Any, state: EngineState) -> dict[tuple[str, str], Endpoint]:
    """Add the control routes to ``app`` (a FastAPI/Starlette app); return them by (path, method)
    for :class:`ControlDispatch`, which answers them ahead of the router."""
    table = handlers(state)

    async def get_weights(request: Request) -> Response:
        try:
            check_token(state, request)
            info = weights_info(state)
        except EngineError as exc:
            return _error(exc)
        return _answer(info)

    # plain Starlette routes: each takes the request and parses its own body (no FastAPI dependency
    # solving per call: 256 engines in one process took a refit's 512 calls at about 0.8 ms each)
    endpoints: dict[tuple[str, str], Endpoint] = {}
    for op, path in CONTROL_ROUTES.items():
        endpoints[path, "POST"] = _endpoint(state, op, table[op])
    endpoints[CONTROL_WEIGHTS, "GET"] = get_weights
    for (path, method), endpoint in endpoints.items():
        name = endpoint.__name__ if method == "POST" else ControlOp.GET_WEIGHTS_VERSION.value
        app.add_route(path, endpoint, methods=[method], name=name, include_in_schema=False)
    return endpoints


def _endpoint(state: EngineState, op: ControlOp, handler: Handler) -> Endpoint:
    async def endpoint(request: Request) -> Response:
        return await run_op(state, request, op, handler)

    endpoint.__name__ = op.value
    return endpoint


class ControlDispatch:
    """The control calls, answered ahead of the app's middleware stack and router: a request whose
    exact path and method are a control route's goes to that route's endpoint by one dict lookup
    (:meth:`takes`). Through the app it passed FastAPI's and Starlette's layers and then the
    router's walk over the routes in order, matching each one's pattern (a load walked 11 of them,
    an announce 17): together about as much CPU as the control call itself, and 256 engines in one
    process answer three rounds of 256 such calls per refit. ``guard`` wraps the answering app in
    what every route has in front of it (``drs_engine.server.app``: the app's 500 handler and
    :class:`~.auth.EngineAuth`'s token check). Anything else (another method, a trailing slash, a
    path under a ``root_path``) goes through the app as before, so its answers (404, 405,
    redirects) are the router's. An API error the endpoint raises instead of answering gets the
    app's error body (:func:`~drs_protocol.fastapi_errors.api_error_response`), as from the
    router."""

    def __init__(self, endpoints: Mapping[tuple[str, str], Endpoint], guard: Callable[[ASGIApp], ASGIApp]) -> None:
        self.endpoints = dict(endpoints)
        self.app = guard(self._answer)

    def takes(self, scope: Scope) -> bool:
        """Whether ``scope`` (an HTTP request) is exactly a control route's path and method."""
        return not scope.get("root_path") and (scope["path"], scope["method"]) in self.endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = self.endpoints[scope["path"], scope["method"]]
        try:
            response = await endpoint(Request(scope, receive))
        except ApiError as exc:
            response = api_error_response(exc)
        await response(scope, receive, send)
