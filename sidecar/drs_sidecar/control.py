"""The engines' control API (engine_image/drs_engine/server/control.py), as the sidecar calls it.

Every call carries the bearer token and a named timeout: ``call_s`` for quick calls (versions,
prefix-cache reset, sleep, wake) and ``load_s`` for a weights load (a checkpoint read can take
minutes). A call never raises for what an engine answered; it returns a :class:`CallResult`,
whose answer is parsed with :mod:`drs_protocol.control`'s models (an answer that does not parse
is a failed call saying so).

The token rotates (``drs_operator.manifests.rotation``): a client given ``refresh`` (the sidecar
reading the fleet's control Secret again) answers an engine's 401 by reading the token once more
and, when it changed, repeating the call once with the new one; a 401 with the same token is the
call's answer.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import httpx
from drs_protocol import fields
from drs_protocol.control import LoadWeights, WeightsInfo, answer_model
from drs_protocol.routes import CONTROL_ROUTES, CONTROL_WEIGHTS, HEALTH, ControlOp
from pydantic import BaseModel, ConfigDict, ValidationError

#: Connections kept per engine: the sidecar makes one call per engine at a time (a few spare).
MAX_CONNECTIONS_PER_ENGINE: Final = 4
#: Idle connections expire before the engine's uvicorn keep-alive timeout (5 s) closes them, so a
#: call never goes out on a connection the engine is closing.
KEEPALIVE_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class CallResult:
    url: str
    ok: bool
    status: int | None  #: None when no answer came (refused, timed out)
    detail: str  #: the engine's error message, or what went wrong on the way
    elapsed_s: float
    #: What the engine holds, as it answered (None when it did not answer 200).
    weights_version: str | None = None
    weights_digest: str | None = None
    #: The parsed answer: a ``ControlAnswer`` of the op's result, or a :class:`WeightsInfo`.
    answer: BaseModel | None = None
    #: No answer came within the call's timeout (``status`` None: the engine may be hung).
    timed_out: bool = False
    #: The ``error.type`` of an error answer (``drs_protocol.collective.COLLECTIVE_ERROR_TYPE`` …).
    error_type: str | None = None


class _Health(BaseModel):
    model_config = ConfigDict(extra="allow")


class ControlClient:
    """One connection pool per engine: httpcore assigns a request by scanning every connection of
    its pool, so one shared pool over N engines costs O(N) per call (O(N²) per fan-out; at 256
    engines that was most of a refit's CPU time, ``bench/refit_scale.py``)."""

    def __init__(
        self,
        token: str,
        *,
        call_s: float = 30.0,
        load_s: float = 1800.0,
        connect_s: float = 5.0,
        refresh: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        self.call_s = call_s
        self.load_s = load_s
        self.token = token
        self._refresh = refresh
        self._headers = fields.control_auth(token)
        self._timeout = httpx.Timeout(call_s, connect=connect_s)
        self._clients: dict[str, httpx.AsyncClient] = {}

    def _client(self, url: str) -> httpx.AsyncClient:
        client = self._clients.get(url)
        if client is None:
            limits = httpx.Limits(
                max_connections=MAX_CONNECTIONS_PER_ENGINE,
                max_keepalive_connections=MAX_CONNECTIONS_PER_ENGINE,
                keepalive_expiry=KEEPALIVE_S,
            )
            client = httpx.AsyncClient(timeout=self._timeout, limits=limits)
            self._clients[url] = client
        return client

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()

    async def weights(self, url: str) -> CallResult:
        """``GET /control/weights``: the version and digest the engine holds."""
        return await self._call("GET", url, CONTROL_WEIGHTS, None, self.call_s, WeightsInfo)

    async def health(self, url: str, timeout: float) -> CallResult:
        """``GET /health`` (why an engine is not ready: its 503's ``error_type``)."""
        return await self._call("GET", url, HEALTH, None, timeout, _Health)

    async def load_checkpoint(self, url: str, path: str, version: str) -> CallResult:
        """The engine loads the checkpoint at ``path`` and serves it as ``version`` (its ``load_weights``)."""
        return await self.op(url, ControlOp.LOAD_WEIGHTS, LoadWeights(path=path, version=version), timeout=self.load_s)

    async def op(
        self, url: str, op: ControlOp, body: BaseModel | None = None, *, timeout: float | None = None
    ) -> CallResult:
        """``POST`` the route of ``op`` with ``body`` (the op's request model of
        :data:`drs_protocol.control.OPS`); ``timeout`` defaults to ``call_s`` (collective steps
        and loads pass ``load_s``)."""
        payload = {} if body is None else body.model_dump(mode="json")
        return await self._call(
            "POST", url, CONTROL_ROUTES[op], payload, self.call_s if timeout is None else timeout, answer_model(op)
        )

    async def _send(
        self, method: str, url: str, route: str, body: dict[str, Any] | None, timeout: float
    ) -> httpx.Response:
        """One call; a 401 repeated once when ``refresh`` gives a token other than the one refused."""
        request = self._client(url).request
        response = await request(method, url + route, json=body, timeout=timeout, headers=self._headers)
        if response.status_code != 401 or self._refresh is None:
            return response
        try:
            token = await self._refresh()
        except Exception:  # the Secret unreadable: the engine's 401 is the answer
            return response
        if token == self.token:
            return response
        self.token, self._headers = token, fields.control_auth(token)
        return await request(method, url + route, json=body, timeout=timeout, headers=self._headers)

    async def _call(
        self,
        method: str,
        url: str,
        route: str,
        body: dict[str, Any] | None,
        timeout: float,
        model: type[BaseModel],
    ) -> CallResult:
        started = time.perf_counter()
        try:
            response = await self._send(method, url, route, body, timeout)
        except httpx.TimeoutException:
            elapsed = time.perf_counter() - started
            return CallResult(url, False, None, f"no answer within {timeout:g}s", elapsed, timed_out=True)
        except httpx.TransportError as exc:
            return CallResult(url, False, None, f"unreachable: {exc}", time.perf_counter() - started)
        elapsed = time.perf_counter() - started
        if response.status_code == 200:
            try:
                answer = model.model_validate_json(response.content)
            except ValidationError as exc:
                return CallResult(url, False, 200, f"its answer breaks the control API's contract: {exc}", elapsed)
            version = getattr(answer, "weights_version", None)
            digest = getattr(answer, "weights_digest", None)
            return CallResult(url, True, 200, "", elapsed, version, digest, answer)
        try:
            data = response.json()
        except ValueError:
            data = {}
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        kind = error.get("type") if isinstance(error, dict) else None
        detail = str(message or response.text[:500])
        return CallResult(
            url, False, response.status_code, detail, elapsed, error_type=kind if isinstance(kind, str) else None
        )
