"""The trainer-facing HTTP API (on localhost in the trainer's pod).

==========================  ========================================  ===================================
``POST /v1/refit``          ``{"path": str, "version": str}``         200 every engine serves it (then
                                                                      published); 502 some failed or were
                                                                      not ready (report names them); 409
                                                                      a refit runs; 400 bad body
``POST /v1/prefix_cache/reset``  ``{}``                               every engine empties its cache
``POST /v1/sleep``          ``{"tags": [...]}`` (empty: all)          release GPU memory (engines 503)
``POST /v1/wake``           ``{"tags": [...]}``                       resume
``POST /v1/collective/init``  ``{"ip", "port", "train_world_size"}``  every engine joins the trainer's
                                                                      NCCL group; answers the ranks and
                                                                      ``world_size`` (503 if an engine is
                                                                      not ready)
``POST /v1/collective/prepare``  ``{"state_dict_info": {...}}``       names, shapes, dtypes to come
``POST /v1/collective/update``   ``{"version", "drain", "recompute_kv",  receive the broadcast; ``path``: a
                                 "path"}``                            checkpoint of the same weights for
                                                                      engines that come back later
``GET /v1/fleet``           —                                         engines, the version each serves,
                                                                      desired and published weights
``GET /healthz``            —                                         liveness
``GET /metrics``            —                                         Prometheus (:mod:`.metrics`)
==========================  ========================================  ===================================

Collective steps (:mod:`drs_sidecar.collective`) call every engine at once; the trainer joins
the group with its own ranks while its call here is in flight. 409 when a refit runs, or for a
prepare/update without a group.

A fan-out answers with its report: ``complete``, ``ok``, ``failed`` (engine, URL, why) and
``pending`` (engines not ready). Every ``reconcile_s`` seconds the desired weights are loaded on
any ready engine serving another version (:meth:`~drs_sidecar.refit.Refitter.reconcile_once`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from drs_protocol.control import MemoryTags
from drs_protocol.routes import HEALTHZ, METRICS, ControlOp, TrainerRoute
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from drs_sidecar.collective import NotAllReady
from drs_sidecar.fleet import FleetError
from drs_sidecar.refit import MAX_VERSION_CHARS, NoGroup, RefitBusy, Refitter, Report

log = logging.getLogger(__name__)

#: Control bodies are small.
MAX_BODY_BYTES = 64 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RefitRequest(_Strict):
    path: str = Field(min_length=1, description="checkpoint the engines load (a path they can read)")
    version: str = Field(min_length=1, max_length=MAX_VERSION_CHARS, description="the version they serve it as")


class CollectiveInit(_Strict):
    ip: str = Field(min_length=1, description="the trainer's rendezvous address (its rank 0)")
    port: int = Field(ge=1, le=65535)
    train_world_size: int = Field(ge=1, description="the trainer's ranks; the engines' come after")


class CollectivePrepare(_Strict):
    state_dict_info: dict[str, Any]


class CollectiveUpdate(_Strict):
    version: str = Field(min_length=1, max_length=MAX_VERSION_CHARS)
    drain: bool = True
    recompute_kv: bool = False
    path: str | None = Field(None, min_length=1, description="a checkpoint of these weights, for late engines")


def _error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status, **extra}}, status_code=status)


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ValueError(f"body: over {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw or b"{}")
    except ValueError as exc:
        raise ValueError(f"body: not valid JSON ({exc})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors())
        raise ValueError(problems) from None


#: What a route refuses before any engine is called, and :func:`_refused` answers.
REFUSALS = (ValueError, NotAllReady, RefitBusy, NoGroup, FleetError)


def _refused(exc: Exception) -> JSONResponse:
    """400 a bad body; 409 a refit running or no collective group; 503 the fleet unreadable or
    not ready (naming the engines)."""
    if isinstance(exc, ValueError):
        return _error(400, str(exc))
    if isinstance(exc, RefitBusy | NoGroup):
        return _error(409, str(exc))
    if isinstance(exc, NotAllReady):
        return _error(503, str(exc), engines=[e.name for e in exc.engines])
    return _error(503, str(exc))


def _report(report: Report) -> JSONResponse:
    return JSONResponse(report.as_dict(), status_code=200 if report.complete else 502)


def build_app(refitter: Refitter, *, reconcile_s: float = 5.0) -> FastAPI:
    async def reconcile_forever() -> None:
        while True:
            await asyncio.sleep(reconcile_s)
            try:
                await refitter.reconcile_once()
            except FleetError as exc:
                log.warning("reconcile: %s", exc)
            except Exception:
                log.exception("reconcile failed")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(reconcile_forever(), name="weights-reconcile")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await refitter.control.close()
            await refitter.fleet.close()

    app = FastAPI(title="drs sidecar", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.post(TrainerRoute.REFIT)
    async def refit(request: Request) -> Response:
        try:
            body: RefitRequest = await _parse(request, RefitRequest)
            report = await refitter.refit(body.path, body.version)
        except REFUSALS as exc:
            return _refused(exc)
        return _report(report)

    @app.post(TrainerRoute.COLLECTIVE_INIT)
    async def collective_init(request: Request) -> Response:
        try:
            body: CollectiveInit = await _parse(request, CollectiveInit)
            layout, report = await refitter.collective_init(body.ip, body.port, body.train_world_size)
        except REFUSALS as exc:
            return _refused(exc)
        return JSONResponse(
            {**report.as_dict(), "group": layout.as_dict()}, status_code=200 if report.complete else 502
        )

    async def collective(request: Request, model: type[BaseModel]) -> Response:
        try:
            body: Any = await _parse(request, model)
            if isinstance(body, CollectivePrepare):
                report = await refitter.collective_prepare(body.state_dict_info)
            else:
                report = await refitter.collective_update(
                    body.version, drain=body.drain, recompute_kv=body.recompute_kv, path=body.path
                )
        except REFUSALS as exc:
            return _refused(exc)
        return _report(report)

    @app.post(TrainerRoute.COLLECTIVE_PREPARE)
    async def collective_prepare(request: Request) -> Response:
        return await collective(request, CollectivePrepare)

    @app.post(TrainerRoute.COLLECTIVE_UPDATE)
    async def collective_update(request: Request) -> Response:
        return await collective(request, CollectiveUpdate)

    async def broadcast(request: Request, op: ControlOp, model: type[MemoryTags] | None) -> Response:
        try:
            body = await _parse(request, model) if model is not None else None
            return _report(await refitter.broadcast(op, body))
        except REFUSALS as exc:
            return _refused(exc)

    @app.post(TrainerRoute.PREFIX_CACHE_RESET)
    async def reset(request: Request) -> Response:
        return await broadcast(request, ControlOp.RESET_PREFIX_CACHE, None)

    @app.post(TrainerRoute.SLEEP)
    async def sleep(request: Request) -> Response:
        return await broadcast(request, ControlOp.RELEASE_MEMORY, MemoryTags)

    @app.post(TrainerRoute.WAKE)
    async def wake(request: Request) -> Response:
        return await broadcast(request, ControlOp.RESUME_MEMORY, MemoryTags)

    @app.get(TrainerRoute.FLEET)
    async def fleet() -> Response:
        try:
            engines = await refitter.fleet.engines()
        except FleetError as exc:
            return _error(503, str(exc))
        versions = await asyncio.gather(*(refitter.control.weights_version(e.url) for e in engines if e.url))
        served = {v.url: v.body.get("weights_version") for v in versions if v.ok}  # unanswered: None
        desired = refitter.desired
        return JSONResponse(
            {
                "desired": None if desired is None else {"path": desired.path, "version": desired.version},
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
                        "weights_version": served.get(e.url or ""),
                    }
                    for e in engines
                ],
            }
        )

    @app.get(HEALTHZ)
    async def healthz() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get(METRICS)
    async def metrics() -> Response:
        return Response(refitter.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
