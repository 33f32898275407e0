"""The trainer's side of ``drs sidecar``'s API: requests are :mod:`drs_protocol.control`'s trainer models,
answers :mod:`drs_protocol.trainer_api`'s.

Fan-outs answer a :class:`~drs_protocol.trainer_api.FanOutReport`; one that did not reach every
engine (the sidecar's 502) raises :class:`~drs_client.errors.EnginesFailed` (a refit:
:class:`~drs_client.errors.RefitIncomplete`) naming each engine; any other error body raises
:class:`~drs_client.errors.SidecarRejected` with its status and message.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Final, TypeVar

import httpx
from drs_protocol import env
from drs_protocol.control import (
    IpcBuffer,
    MemoryTags,
    PrepareRefitInfo,
    Refit,
    TrainerCollectiveInit,
    TrainerCollectiveUpdate,
    TrainerIpcUpdate,
)
from drs_protocol.routes import HEALTHZ, TrainerRoute
from drs_protocol.trainer_api import CollectiveInitReport, FanOutReport, FleetReport
from pydantic import BaseModel, ValidationError

from drs_client.errors import (
    EnginesFailed,
    NoSidecar,
    RefitIncomplete,
    SidecarRejected,
    SidecarUnreachable,
)

#: Seconds for a call that touches every engine briefly (reset, sleep, wake, the fleet's view).
CALL_TIMEOUT_S: Final = 60.0
#: Seconds for a call that loads weights on every engine (the sidecar's own load timeout is 30 min).
LOAD_TIMEOUT_S: Final = 1800.0 + 60.0
#: Seconds to connect to the sidecar (it is on localhost).
CONNECT_TIMEOUT_S: Final = 5.0
#: Connections to the sidecar at once.
MAX_CONNECTIONS: Final = 4

ReportT = TypeVar("ReportT", bound=FanOutReport)


def sidecar_url(url: str | None) -> str:
    """``url``, else ``$DRS_SIDECAR_URL`` (``NoSidecar`` when neither is set)."""
    chosen = url or os.environ.get(env.SIDECAR_URL)
    if not chosen:
        raise NoSidecar(f"no sidecar URL: pass sidecar_url= or set ${env.SIDECAR_URL}")
    return chosen.rstrip("/")


class AsyncSidecar:
    """``drs sidecar``'s trainer API at ``url`` (an ``httpx.AsyncClient`` of its own)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(CALL_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS),
        )

    async def healthy(self) -> bool:
        try:
            return (await self._http.get(HEALTHZ)).status_code == 200
        except httpx.HTTPError:
            return False

    async def refit(self, path: str, version: str, *, digest: str | None = None) -> FanOutReport:
        """Every engine loads ``path`` as ``version`` (``RefitIncomplete`` names those that did not);
        ``digest``: the :mod:`drs_protocol.weights_digest` of what the trainer wrote there, which
        every engine must hold afterwards."""
        body = Refit(path=path, version=version, digest=digest)
        return await self._fan_out(TrainerRoute.REFIT, body, FanOutReport, LOAD_TIMEOUT_S, RefitIncomplete)

    async def reset_prefix_cache(self) -> FanOutReport:
        return await self._fan_out(TrainerRoute.PREFIX_CACHE_RESET, None, FanOutReport, CALL_TIMEOUT_S)

    async def sleep(self, tags: Sequence[str] = ()) -> FanOutReport:
        """Every engine releases memory (``tags``; empty: all) and answers 503 until :meth:`wake`."""
        return await self._fan_out(TrainerRoute.SLEEP, MemoryTags(tags=list(tags)), FanOutReport, CALL_TIMEOUT_S)

    async def wake(self, tags: Sequence[str] = ()) -> FanOutReport:
        return await self._fan_out(TrainerRoute.WAKE, MemoryTags(tags=list(tags)), FanOutReport, CALL_TIMEOUT_S)

    async def collective_init(self, ip: str, port: int, train_world_size: int) -> CollectiveInitReport:
        body = TrainerCollectiveInit(ip=ip, port=port, train_world_size=train_world_size)
        return await self._fan_out(TrainerRoute.COLLECTIVE_INIT, body, CollectiveInitReport, LOAD_TIMEOUT_S)

    async def collective_prepare(self, state_dict_info: dict[str, Any]) -> FanOutReport:
        body = PrepareRefitInfo(state_dict_info=state_dict_info)
        return await self._fan_out(TrainerRoute.COLLECTIVE_PREPARE, body, FanOutReport, LOAD_TIMEOUT_S)

    async def collective_update(
        self,
        version: str,
        *,
        drain: bool = True,
        recompute_kv: bool = False,
        path: str | None = None,
        digest: str | None = None,
    ) -> FanOutReport:
        body = TrainerCollectiveUpdate(
            version=version, drain=drain, recompute_kv=recompute_kv, path=path, digest=digest
        )
        return await self._fan_out(TrainerRoute.COLLECTIVE_UPDATE, body, FanOutReport, LOAD_TIMEOUT_S)

    async def ipc_update(
        self,
        version: str,
        state_dict_info: dict[str, Any],
        buffers: Sequence[IpcBuffer | dict[str, Any]],
        *,
        path: str | None = None,
        digest: str | None = None,
    ) -> FanOutReport:
        """The colocated refit: every engine copies the trainer's CUDA-IPC-shared packed buffers."""
        body = TrainerIpcUpdate.model_validate(
            {
                "version": version,
                "state_dict_info": state_dict_info,
                "buffers": list(buffers),
                "path": path,
                "digest": digest,
            }
        )
        return await self._fan_out(TrainerRoute.IPC_UPDATE, body, FanOutReport, LOAD_TIMEOUT_S)

    async def fleet(self) -> FleetReport:
        """``GET /v1/fleet``: the version every engine serves now, as each answers the sidecar."""
        response = await self._send("GET", TrainerRoute.FLEET, None, CALL_TIMEOUT_S)
        if response.status_code != 200:
            raise SidecarRejected(TrainerRoute.FLEET, response.status_code, _json(response))
        return _parse(TrainerRoute.FLEET, response, FleetReport)

    async def _fan_out(
        self,
        route: TrainerRoute,
        body: BaseModel | None,
        answer: type[ReportT],
        timeout_s: float,
        incomplete: type[EnginesFailed] = EnginesFailed,
    ) -> ReportT:
        response = await self._send("POST", route, body, timeout_s)
        if response.status_code not in (200, 502) or "error" in _json(response):
            raise SidecarRejected(route, response.status_code, _json(response))
        report = _parse(route, response, answer)
        if not report.complete:
            raise incomplete(route, report)
        return report

    async def _send(self, method: str, route: str, body: BaseModel | None, timeout_s: float) -> httpx.Response:
        content = b"{}" if body is None else body.model_dump_json().encode()
        try:
            if method == "GET":
                return await self._http.get(route, timeout=timeout_s)
            return await self._http.post(
                route, content=content, headers={"content-type": "application/json"}, timeout=timeout_s
            )
        except httpx.HTTPError as exc:
            raise SidecarUnreachable(self.url + route, repr(exc)) from exc

    async def close(self) -> None:
        await self._http.aclose()


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        data = response.json()
    except ValueError:
        return {"error": {"message": response.text[:500], "type": "not_json"}}
    return data if isinstance(data, dict) else {"error": {"message": str(data)[:500], "type": "not_an_object"}}


ModelT = TypeVar("ModelT", bound=BaseModel)


def _parse(route: str, response: httpx.Response, model: type[ModelT]) -> ModelT:
    try:
        return model.model_validate(_json(response))
    except ValidationError as exc:
        raise SidecarRejected(route, response.status_code, {"error": {"message": f"answer: {exc}"}}) from exc
