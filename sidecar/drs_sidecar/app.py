"""The trainer-facing HTTP API (on localhost in the trainer's pod).

==========================  ========================================  ===================================
``POST /v1/refit``          ``{"path", "version", "digest"?}``        200 every engine holds it (then
                                                                      published); 502 some failed or were
                                                                      not ready (report names them); 409
                                                                      a refit runs; 400 bad body
``POST /v1/prefix_cache/reset``  ``{}``                               every engine empties its cache
``POST /v1/sleep``          ``{"tags": [...]}`` (empty: all)          release GPU memory (engines 503)
``POST /v1/wake``           ``{"tags": [...]}``                       resume
``POST /v1/profile/start``  ``{}``                                    every engine starts profiling
``POST /v1/profile/stop``   ``{}``                                    every engine stops (answers duration)
``POST /v1/collective/init``  ``{"ip", "port", "train_world_size"}``  every engine joins the trainer's
                                                                      NCCL group; answers the ranks and
                                                                      ``world_size`` (503 if an engine is
                                                                      not ready)
``POST /v1/collective/prepare``  ``{"state_dict_info": {...}}``       names, shapes, dtypes to come
``POST /v1/collective/update``   ``{"version", "drain", "recompute_kv",  receive the broadcast; ``path``: a
                                 "path", "digest"}``                  checkpoint of the same weights for
                                                                      engines that come back later
``POST /v1/weights/ipc``    ``{"version", "state_dict_info",         colocated refit: every engine copies
                            "buffers", "path", "digest"}``            the trainer's CUDA-IPC-shared packed
                                                                      buffers (same host; torch engines)
``GET /v1/fleet``           —                                         engines, the version each serves,
                                                                      desired and published weights
``GET /healthz``            —                                         liveness
``GET /metrics``            —                                         Prometheus (:mod:`.metrics`)
==========================  ========================================  ===================================

Requests are :mod:`drs_protocol.control`'s trainer models (``Refit``, ``TrainerCollectiveInit``,
``PrepareRefitInfo``, ``TrainerCollectiveUpdate``, ``TrainerIpcUpdate``, ``MemoryTags``); answers are :mod:`drs_protocol.trainer_api`'s models (the reports and the fleet
view, which ``drs_client`` parses). ``digest``:
the trainer's :mod:`drs_protocol.weights_digest` of what it sent; an engine holding another digest
afterwards is a failed engine (:func:`drs_sidecar.report.verify_digests`).

Bodies are streamed against :data:`MAX_BODY_BYTES` (413 past it, like the engines); every refusal
is an error of :mod:`drs_sidecar.errors`, answered in the one error body of
:mod:`drs_protocol.errors` before any engine is called.

Collective steps (:mod:`drs_sidecar.collective`) call every engine at once; the trainer joins
the group with its own ranks while its call here is in flight. 409 when a refit runs, or for a
prepare/update without a group. Each step answers within ``--collective-timeout``; a failed one is
502 with ``group_abort`` (the culprit, each failed member's fault, the abort on every member:
:mod:`drs_sidecar.group_abort`).

A refit first announces its target weights to every engine, before any load
(:mod:`drs_sidecar.targets`: engines not holding them refuse new legs until they do); its report
says how long that took (``target_announced_s``). The sidecar serves once it has read the resource
(desired weights and engines) and made its first reconcile pass (:data:`STARTUP_READ_S` at most),
so a first refit announces at once, over open connections.

A fan-out answers with its report: ``complete``, ``ok``, ``failed`` (engine, URL, why) and
``pending`` (engines not ready). Every ``reconcile_s`` seconds the desired weights are loaded on
any ready engine serving another version (:meth:`~drs_sidecar.refit.Refitter.reconcile_once`), and
the version every engine serves is recorded on the resource (annotation ``disagg.dev/engine-weights``)
for the operator's per-engine status and its ``Degraded=WeightsSplit`` condition.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any, Final, TypeVar

from drs_protocol.body import read_body
from drs_protocol.control import (
    MemoryTags,
    PrepareRefitInfo,
    Refit,
    TrainerCollectiveInit,
    TrainerCollectiveUpdate,
    TrainerIpcUpdate,
)
from drs_protocol.fastapi_errors import install_error_handlers
from drs_protocol.routes import HEALTHZ, METRICS, ControlOp, TrainerRoute
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from drs_sidecar.errors import BadRequestError, FleetError
from drs_sidecar.refit import Refitter, checked
from drs_sidecar.report import Report

log = logging.getLogger(__name__)
#: Seconds the sidecar waits at start for its first read of the resource (desired weights, engines)
#: and its first reconcile pass before it serves anyway.
STARTUP_READ_S: Final = 20.0

#: Control bodies are small; larger gets 413.
MAX_BODY_BYTES: Final = 64 * 1024

ModelT = TypeVar("ModelT", bound=BaseModel)


async def parse_body(request: Request, model: type[ModelT]) -> ModelT:
    """The body (empty: ``{}``) as ``model``: 413 over :data:`MAX_BODY_BYTES`, 400 naming every
    problem otherwise."""
    raw = await read_body(request, MAX_BODY_BYTES)
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise BadRequestError(f"body: not valid JSON ({exc})") from None
    return checked(model, data)


def report_response(report: Report, **extra: Any) -> JSONResponse:
    """A fan-out's report: 200 when every engine did it, else 502."""
    return JSONResponse({**report.as_dict(), **extra}, status_code=200 if report.complete else 502)


def build_app(refitter: Refitter, *, reconcile_s: float = 5.0) -> FastAPI:
    """The trainer API over ``refitter``; its lifespan runs :func:`reconcile_forever`."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        restored = asyncio.Event()
        task = asyncio.create_task(reconcile_forever(refitter, reconcile_s, restored), name="weights-reconcile")
        with contextlib.suppress(TimeoutError):  # serve once the fleet is known (a refit's announce needs it)
            await asyncio.wait_for(restored.wait(), STARTUP_READ_S)
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await refitter.control.close()
            await refitter.fleet.close()

    app = FastAPI(title="drs sidecar", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app, log)
    _add_refit_routes(app, refitter)
    _add_collective_routes(app, refitter)
    _add_broadcast_routes(app, refitter)
    _add_status_routes(app, refitter)
    return app


async def reconcile_forever(refitter: Refitter, interval_s: float, tried: asyncio.Event | None = None) -> None:
    """First the desired weights stored on the resource and the fleet's engines (a restarted
    sidecar knows them at once; ``tried`` is set after the first attempt), then every
    ``interval_s``: bring engines at other weights to the desired ones."""
    restored = False
    while True:
        try:
            if not restored:
                await refitter.restore()
                restored = True
        except FleetError as exc:
            log.warning("desired weights not read from the resource yet: %s", exc)
        try:
            await refitter.reconcile_once()  # the first at once: engines behind are caught up, their pools open
        except FleetError as exc:
            log.warning("reconcile: %s", exc)
        except Exception:
            log.exception("reconcile failed")
        if tried is not None:
            tried.set()
        await asyncio.sleep(interval_s)


def _add_refit_routes(app: FastAPI, refitter: Refitter) -> None:
    @app.post(TrainerRoute.REFIT)
    async def refit(request: Request) -> Response:
        body = await parse_body(request, Refit)
        return report_response(await refitter.refit(body.path, body.version, body.digest))


def _add_collective_routes(app: FastAPI, refitter: Refitter) -> None:
    @app.post(TrainerRoute.COLLECTIVE_INIT)
    async def collective_init(request: Request) -> Response:
        body = await parse_body(request, TrainerCollectiveInit)
        layout, report = await refitter.collective_init(body.ip, body.port, body.train_world_size)
        return report_response(report, group=layout.as_dict())

    @app.post(TrainerRoute.COLLECTIVE_PREPARE)
    async def collective_prepare(request: Request) -> Response:
        body = await parse_body(request, PrepareRefitInfo)
        return report_response(await refitter.collective_prepare(body.state_dict_info))

    @app.post(TrainerRoute.COLLECTIVE_UPDATE)
    async def collective_update(request: Request) -> Response:
        body = await parse_body(request, TrainerCollectiveUpdate)
        return report_response(await refitter.collective_update(body))

    @app.post(TrainerRoute.IPC_UPDATE)
    async def ipc_update(request: Request) -> Response:
        body = await parse_body(request, TrainerIpcUpdate)
        return report_response(await refitter.ipc_update(body))


def _add_broadcast_routes(app: FastAPI, refitter: Refitter) -> None:
    @app.post(TrainerRoute.PREFIX_CACHE_RESET)
    async def reset() -> Response:
        return report_response(await refitter.broadcast(ControlOp.RESET_PREFIX_CACHE))

    @app.post(TrainerRoute.SLEEP)
    async def sleep(request: Request) -> Response:
        body = await parse_body(request, MemoryTags)
        return report_response(await refitter.broadcast(ControlOp.RELEASE_MEMORY, body))

    @app.post(TrainerRoute.WAKE)
    async def wake(request: Request) -> Response:
        body = await parse_body(request, MemoryTags)
        return report_response(await refitter.broadcast(ControlOp.RESUME_MEMORY, body))

    @app.post(TrainerRoute.PROFILE_START)
    async def profile_start() -> Response:
        return report_response(await refitter.broadcast(ControlOp.START_PROFILE))

    @app.post(TrainerRoute.PROFILE_STOP)
    async def profile_stop() -> Response:
        return report_response(await refitter.broadcast(ControlOp.STOP_PROFILE))


def _add_status_routes(app: FastAPI, refitter: Refitter) -> None:
    @app.get(TrainerRoute.FLEET)
    async def fleet() -> Response:
        return JSONResponse(await fleet_view(refitter))

    @app.get(HEALTHZ)
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get(METRICS)
    async def metrics() -> Response:
        return Response(refitter.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def fleet_view(refitter: Refitter) -> dict[str, Any]:
    """``GET /v1/fleet``: every engine with the version and digest it holds (None: it did not
    answer), and the desired and published weights."""
    engines = await refitter.fleet.engines()
    answers = await asyncio.gather(*(refitter.control.weights(e.url) for e in engines if e.url))
    held = {a.url: a for a in answers if a.ok}
    desired = refitter.desired
    return {
        "desired": None
        if desired is None
        else {"path": desired.path, "version": desired.version, "digest": desired.digest},
        "published": refitter.published,
        "refitting": refitter.busy,
        "collective_group": None if refitter.group is None else refitter.group.as_dict(),
        "engines": [
            {
                "engine": e.name,
                "role": e.role,
                "replica": e.replica,
                "url": e.url,
                "ready": e.ready,
                "weights_version": _held(held, e.url, "weights_version"),
                "weights_digest": _held(held, e.url, "weights_digest"),
            }
            for e in engines
        ],
    }


def _held(answers: dict[str, Any], url: str | None, what: str) -> str | None:
    answer = answers.get(url or "")
    return None if answer is None else getattr(answer, what, None)
