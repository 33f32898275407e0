"""The engines' control API (engine_image/drs_engine/server/control.py), as the sidecar calls it.

Every call carries the bearer token and a named timeout: ``call_s`` for quick calls (versions,
prefix-cache reset, sleep, wake) and ``load_s`` for a weights load (a checkpoint read can take
minutes). A call never raises for what an engine answered; it returns a :class:`CallResult`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

import httpx
from drs_protocol import fields
from drs_protocol.control import LoadWeights
from drs_protocol.routes import CONTROL_ROUTES, CONTROL_WEIGHTS, ControlOp
from pydantic import BaseModel

#: Connections kept per engine: the sidecar makes one call per engine at a time.
MAX_CONNECTIONS: Final = 256


@dataclass(frozen=True, slots=True)
class CallResult:
    url: str
    ok: bool
    status: int | None  #: None when no answer came (refused, timed out)
    detail: str  #: the engine's error message, or what went wrong on the way
    body: dict[str, Any]
    elapsed_s: float


class ControlClient:
    def __init__(self, token: str, *, call_s: float = 30.0, load_s: float = 1800.0, connect_s: float = 5.0) -> None:
        self.call_s = call_s
        self.load_s = load_s
        self._client = httpx.AsyncClient(
            headers=fields.control_auth(token),
            timeout=httpx.Timeout(call_s, connect=connect_s),
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS),
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def weights_version(self, url: str) -> CallResult:
        return await self._call("GET", url, CONTROL_WEIGHTS, None, self.call_s)

    async def load_weights(self, url: str, path: str, version: str) -> CallResult:
        body = LoadWeights(path=path, version=version).model_dump()
        return await self._call("POST", url, CONTROL_ROUTES[ControlOp.LOAD_WEIGHTS], body, self.load_s)

    async def op(
        self, url: str, op: ControlOp, body: BaseModel | None = None, *, timeout: float | None = None
    ) -> CallResult:
        """``POST`` the route of ``op`` with ``body`` (one of :mod:`drs_protocol.control`'s models);
        ``timeout`` defaults to ``call_s`` (collective steps pass ``load_s``)."""
        payload = {} if body is None else body.model_dump()
        return await self._call("POST", url, CONTROL_ROUTES[op], payload, self.call_s if timeout is None else timeout)

    async def _call(self, method: str, url: str, route: str, body: dict[str, Any] | None, timeout: float) -> CallResult:
        started = time.perf_counter()
        try:
            response = await self._client.request(method, url + route, json=body, timeout=timeout)
        except httpx.TimeoutException:
            return CallResult(url, False, None, f"no answer within {timeout:g}s", {}, time.perf_counter() - started)
        except httpx.TransportError as exc:
            return CallResult(url, False, None, f"unreachable: {exc}", {}, time.perf_counter() - started)
        elapsed = time.perf_counter() - started
        try:
            data = response.json()
        except ValueError:
            data = {}
        payload = data if isinstance(data, dict) else {}
        if response.status_code == 200:
            return CallResult(url, True, 200, "", payload, elapsed)
        error = payload.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        return CallResult(url, False, response.status_code, str(message or response.text[:500]), payload, elapsed)
