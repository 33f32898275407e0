"""The engine HTTP server: one FastAPI app per engine, the same for every backend.

Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` — serving (:mod:`.serving`);
- ``GET /v1/models`` — the one model served, OpenAI's model list (:mod:`drs_protocol.model_list`);
- ``GET /health`` — 200 once the model is loaded, 503 before, while draining (SIGTERM), while it
  does not hold the desired weights it started under (``weights_pending``,
  :mod:`drs_engine.weights.catchup`) and while the weights hold part of a failed update
  (``weights_incomplete``, until a load completes);
- ``GET /server_info`` — ``{"disaggregated_params", "max_batch_size", "tokens_per_block", …}``;
- ``GET /v1/gang`` — an engine wider than a node: its leader's report of every rank (joined, node,
  workers alive) and the gang's phase (``drs_protocol.gang``); 404 on an engine of one pod;
- ``GET /metrics`` — Prometheus text from this server's own registry (:mod:`drs_engine.metrics`);
- ``GET /v1/disagg/kv/{ctx_request_id}`` — a prefill engine hands a context state to a decode
  engine and forgets it (sim: JSON; torch: ``?transport=http|cuda_ipc``, a binary KV frame;
  trtllm moves KV with its cache transceiver: 501);
- ``/control/...`` — the control API behind a bearer token (:mod:`.control`), and the weights
  stream a peer catching up reads (:mod:`.peer_stream`). A call whose exact path and method are a
  control route's is answered ahead of the middleware stack and the router
  (:class:`.control.ControlDispatch`, behind the same 500 handler and token check): a refit sends
  each engine about three of them, and 256 engines may share one process.

Every route but ``/health`` and ``/metrics`` needs a bearer token (:mod:`.auth`, in front of all
of them): ``/control/...`` the control token, the others the fleet's serving token (when the
engine has one).

Every error, including unknown routes and bugs, is a JSON body in the OpenAI error shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from drs_protocol import fields, routes
from drs_protocol.auth import Realm
from drs_protocol.errors import error_body
from drs_protocol.fastapi_errors import install_error_handlers
from drs_protocol.lifecycle import DRAINING_ERROR_TYPE, WEIGHTS_PENDING_ERROR_TYPE
from drs_protocol.model_list import model_list
from drs_protocol.token_source import GENERATIONS_HEADER, TokenSource, format_generations
from drs_protocol.weights_state import DesiredWeights
from fastapi import FastAPI, Query
from starlette.middleware.errors import ServerErrorMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from drs_engine import __version__
from drs_engine.config import BackendName, EngineConfig
from drs_engine.errors import EngineError, WeightsIncompleteError
from drs_engine.gang.spec import GangSpec
from drs_engine.metrics import CONTENT_TYPE_LATEST
from drs_engine.server import control, peer_stream, serving
from drs_engine.server.auth import EngineAuth
from drs_engine.server.prefix_held import prefix_held
from drs_engine.server.state import EngineState
from drs_engine.weights.desired import Peers

log = logging.getLogger("drs_engine")


def create_app(
    config: EngineConfig,
    *,
    control_token: str | TokenSource | None,
    serving_token: str | TokenSource | None = None,
    gang: GangSpec | None = None,
    desired_weights: DesiredWeights | None = None,
    weights_peers: Sequence[str] | Peers = (),
    desired_file: Path | None = None,
) -> EngineApp:
    """The app of one engine; the model loads in the app's lifespan (startup), or, for the leader
    of an engine wider than a node, in the background once every rank joined."""
    state = EngineState(
        config,
        control_token=control_token,
        serving_token=serving_token,
        gang=gang,
        desired_weights=desired_weights,
        weights_peers=weights_peers,
        desired_file=desired_file,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await state.start()
        log.info(
            "engine ready: backend=%s role=%s url=%s",
            config.backend.value,
            config.role.value,
            config.resolved_advertise_url(),
        )
        try:
            yield
        finally:
            await state.close()

    app = EngineApp(title="drs engine", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = state
    install_error_handlers(app, log)
    _add_serving_routes(app, state)
    _add_info_routes(app, state)
    control_endpoints = control.register(app, state)
    peer_stream.register(app, state)
    app.add_middleware(EngineAuth, state=state)

    def guard(answer: ASGIApp) -> ASGIApp:
        """What every route has in front of it: the app's 500 handler (a bug's JSON body), then the tokens."""
        handler = app.exception_handlers.get(Exception) or app.exception_handlers.get(500)
        return ServerErrorMiddleware(EngineAuth(answer, state=state), handler=handler)

    app.control = control.ControlDispatch(control_endpoints, guard)
    return app


class EngineApp(FastAPI):
    """The engine's app: its control calls (:class:`~.control.ControlDispatch`) are answered ahead
    of the middleware stack and the router, everything else as any FastAPI app answers it."""

    control: control.ControlDispatch | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.control is not None and scope["type"] == "http" and self.control.takes(scope):
            scope["app"] = self
            await self.control(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _add_serving_routes(app: FastAPI, state: EngineState) -> None:
    """The two turn routes, the KV hand-off a decode engine fetches from a prefill engine and the
    prefix-held lookup a frontend asks on a routing miss."""

    async def chat(request: Request) -> Response:
        return await serving.serve(state, request, chat=True)

    async def completions(request: Request) -> Response:
        return await serving.serve(state, request, chat=False)

    async def kv_export(
        ctx_request_id: int,
        transport: str | None = None,
        copy_event: str | None = Query(None, alias=routes.KV_COPY_EVENT_PARAM),
        prompt_digest: bool = Query(False, alias=routes.KV_PROMPT_DIGEST_PARAM),
    ) -> Response:
        try:
            backend = state.require_backend()
            if transport is not None:
                frame = await backend.export_context_frame(
                    ctx_request_id, transport, copy_event=copy_event, prompt_digest=prompt_digest
                )
            else:
                body = await backend.export_context(ctx_request_id)
        except EngineError as exc:
            if state.metrics is not None:
                state.metrics.kv_exports.labels(status="error").inc()
            return JSONResponse(exc.to_body(), status_code=exc.status)
        state.require_metrics().kv_exports.labels(status="ok").inc()
        if transport is not None:
            return StreamingResponse(
                frame.chunks, media_type=frame.media_type, headers={"content-length": str(frame.length)}
            )
        return JSONResponse(body)

    app.add_api_route(routes.Endpoint.CHAT, chat, methods=["POST"])
    app.add_api_route(routes.Endpoint.COMPLETIONS, completions, methods=["POST"])

    async def held(request: Request) -> Response:
        return await prefix_held(state, request)

    app.add_api_route(routes.KV_EXPORT, kv_export, methods=["GET"])
    app.add_api_route(routes.PREFIX_HELD, held, methods=["POST"])


def _add_info_routes(app: FastAPI, state: EngineState) -> None:
    """Health, the gang report, server info, the model list and metrics."""
    config = state.config

    async def health() -> Response:
        """:func:`health_answer` with the token Secret generations this engine holds (no token)."""
        answer = health_answer()
        sources = {str(Realm.SERVING): state.serving_tokens, str(Realm.CONTROL): state.control_tokens}
        if held := format_generations(sources):
            answer.headers[GENERATIONS_HEADER] = held
        return answer

    def health_answer() -> Response:
        if state.catch_up is not None and state.catch_up.pending:
            body = error_body(503, state.catch_up.reason(), type_=WEIGHTS_PENDING_ERROR_TYPE)
            return JSONResponse(body, status_code=503)
        if not state.ready:
            why = (
                f"the engine's gang is {state.gang.phase}: {state.gang.reason}"
                if state.gang
                else "the engine is still loading"
            )
            return JSONResponse(error_body(503, why), status_code=503)
        if state.draining:
            return JSONResponse(
                error_body(503, "the engine is draining before it stops", type_=DRAINING_ERROR_TYPE), status_code=503
            )
        if state.weights_incomplete is not None:
            incomplete = WeightsIncompleteError(
                f"the engine holds part of a failed weights update: {state.weights_incomplete}"
            )
            return JSONResponse(incomplete.to_body(), status_code=503)
        return JSONResponse({"status": "ok", "asleep": bool(state.released_tags)})

    async def gang_report() -> Response:
        if state.gang is None:
            return JSONResponse(error_body(404, "this engine runs in one pod (no gang)"), status_code=404)
        return JSONResponse(state.gang.report())

    async def server_info() -> Response:
        try:
            return JSONResponse(_server_info(state))
        except EngineError as exc:
            return JSONResponse(exc.to_body(), status_code=exc.status)

    served = model_list(config.served_model_name(), int(time.time())).model_dump(mode="json")

    async def models() -> Response:
        return JSONResponse(served)

    async def metrics() -> Response:
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_api_route(routes.MODELS, models, methods=["GET"])
    app.add_api_route(routes.HEALTH, health, methods=["GET"])
    app.add_api_route(routes.SERVER_INFO, server_info, methods=["GET"])
    app.add_api_route(routes.GANG, gang_report, methods=["GET"])
    app.add_api_route(routes.METRICS, metrics, methods=["GET"])


def _server_info(state: EngineState) -> dict[str, Any]:
    backend = state.require_backend()
    config = state.config
    return {
        "disaggregated_params": {
            "role": config.role.value,
            "ctx_info_endpoint": config.resolved_advertise_url(),
            "cache_transceiver": _transceiver(backend),
        },
        "max_batch_size": config.max_batch_size,
        fields.SERVER_INFO_TOKENS_PER_BLOCK: backend.tokens_per_block,
        "max_num_tokens": config.max_num_tokens,
        "max_model_len": config.model.max_model_len,
        "model": config.served_model_name(),
        "role": config.role.value,
        "backend": backend.name,
        "test_double": backend.test_double,
        "weights_version": backend.weights_version,
        "asleep": sorted(state.released_tags),
        "engine": backend.server_info(),
        **({"gang": state.gang.report()} if state.gang is not None else {}),
    }


def _transceiver(backend: Any) -> str:
    if backend.test_double:
        return "http-kv-fetch (sim)"
    if backend.name == BackendName.TORCH:
        return "torch kv fetch (cuda_ipc on one host, else http)"
    return "trtllm cache transceiver"
