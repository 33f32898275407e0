"""The engines' control API (engine_image/drs_engine/server/control.py), as the sidecar calls it.

Every call carries the bearer token and a named timeout: ``call_s`` for quick calls (versions,
prefix-cache reset, sleep, wake) and ``load_s`` for a weights load (a checkpoint read can take
minutes). A call never raises for what an engine answered; it returns a :class:`CallResult`,
whose answer is parsed with :mod:`drs_protocol.control`'s models (an answer that does not parse
is a failed call saying so).

The token rotates (``drs_operator.manifests.rotation``): a client given ``refresh`` (the sidecar
reading the fleet's control Secret again, mounted or through the API) answers an engine's 401 by
reading the token once more and, when it changed, repeating the call once with the new one (sent
per request from then on; the session keeps the token it was made with); a 401 with the same
token is the call's answer.

An engine's name that does not resolve yet is looked up again for up to ``resolve_s`` (back-off
from ``RESOLVE_FIRST_DELAY_S`` doubling to ``RESOLVE_MAX_DELAY_S``, within the call's own timeout):
a pod's DNS record under the fleet's headless Service is published after the pod is ready (the
EndpointSlice, then CoreDNS's watch and its cache), so a trainer that refits right after a rollout
would otherwise find freshly replaced engines "unreachable". Nothing was sent on such a call, so
repeating it is safe for every op. A refused or timed-out connection is not retried: the name
resolved, and the engine is down or hung.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

import aiohttp
import yarl
from aiohttp.abc import AbstractResolver
from drs_protocol import fields
from drs_protocol.control import LoadAnnounce, LoadWeights, WeightsInfo, answer_model
from drs_protocol.routes import CONTROL_ROUTES, CONTROL_WEIGHTS, HEALTH, ControlOp
from pydantic import BaseModel, ConfigDict, ValidationError

#: Connections kept per engine: the sidecar makes one call per engine at a time (a few spare).
MAX_CONNECTIONS_PER_ENGINE: Final = 4
#: Idle connections expire before the engine's uvicorn keep-alive timeout (5 s) closes them, so a
#: call never goes out on a connection the engine is closing.
KEEPALIVE_S: Final = 2.0
#: Parsed engine route URLs kept (about 20 routes per engine: a few thousand engines' worth).
MAX_PARSED_URLS: Final = 65536
#: ``ClientTimeout``s kept, one per timeout value (a retry's remaining time is not kept past these).
MAX_TIMEOUTS: Final = 64
#: Seconds an engine's name is looked up again while it does not resolve (its DNS record follows
#: the pod's readiness by the EndpointSlice's and CoreDNS's delays), and the back-off between tries.
RESOLVE_S: Final = 20.0
RESOLVE_FIRST_DELAY_S: Final = 0.1
RESOLVE_MAX_DELAY_S: Final = 2.0


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


@dataclass(frozen=True, slots=True)
class Encoded:
    """A request body encoded once (:func:`encoded`) for a fan-out that sends the same body to
    every engine: 256 engines cost one encoding, not 256."""

    data: bytes


def encoded(body: BaseModel) -> Encoded:
    """``body`` (an op's request model) as the JSON bytes every engine of a fan-out is sent."""
    return Encoded(body.model_dump_json().encode())


_EMPTY: Final = Encoded(b"{}")
_JSON: Final = {"Content-Type": "application/json"}


class _Health(BaseModel):
    model_config = ConfigDict(extra="allow")


class ControlClient:
    """One aiohttp session for every engine: its connector keeps a pool per engine (host and
    port), found by key, so a call costs the same at 4 engines as at 256. Its CPU per call is about
    a third of httpx's (``bench/refit_scale.py``: at 256 engines, two calls per engine per refit,
    the client's CPU was most of the sidecar's), and it has no per-pool TLS context to build
    (httpx builds one per client, ~25 ms each). The session is made on the first call, in the
    running event loop; :meth:`close` ends it. Proxies from the environment are not used (the
    engines are the fleet's own pods)."""

    def __init__(
        self,
        token: str,
        *,
        call_s: float = 30.0,
        load_s: float = 1800.0,
        connect_s: float = 5.0,
        resolve_s: float = RESOLVE_S,
        refresh: Callable[[], Awaitable[str]] | None = None,
        resolver: AbstractResolver | None = None,
    ) -> None:
        self.call_s = call_s
        self.load_s = load_s
        self.connect_s = connect_s
        self.resolve_s = resolve_s
        #: how engine names are resolved (None: aiohttp's default; tests pass a double)
        self._resolver = resolver
        self.token = token
        self._refresh = refresh
        self._headers = fields.control_auth(token)
        #: a request's own headers: the body's type, and the token once it changed (the session's
        #: headers hold the one it was made with)
        self._request_headers: dict[str, str] = dict(_JSON)
        self._session: aiohttp.ClientSession | None = None
        #: one ``ClientTimeout`` per timeout value (a few: call, load, health, collective steps)
        self._timeouts: dict[float, aiohttp.ClientTimeout] = {}
        #: each engine route's URL, parsed once (parsing it per call was a tenth of a call's CPU)
        self._urls: dict[str, yarl.URL] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=0,  # no bound over all engines: the refit's own concurrency bounds the calls
                limit_per_host=MAX_CONNECTIONS_PER_ENGINE,
                keepalive_timeout=KEEPALIVE_S,
                resolver=self._resolver,
            )
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    def _timeout(self, seconds: float) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(seconds)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(total=seconds, sock_connect=min(self.connect_s, seconds))
            if len(self._timeouts) < MAX_TIMEOUTS:  # a retry's remaining time is a one-off value
                self._timeouts[seconds] = timeout
        return timeout

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def weights(self, url: str) -> CallResult:
        """``GET /control/weights``: the version and digest the engine holds."""
        return await self._call("GET", url, CONTROL_WEIGHTS, None, self.call_s, WeightsInfo)

    async def health(self, url: str, timeout: float) -> CallResult:
        """``GET /health`` (why an engine is not ready: its 503's ``error_type``)."""
        return await self._call("GET", url, HEALTH, None, timeout, _Health)

    def load_body(
        self, path: str, version: str, effective_at: float | None = None, announce: LoadAnnounce | None = None
    ) -> Encoded:
        """A load's body (:class:`~drs_protocol.control.LoadWeights`), encoded once for every
        engine of a refit: the checkpoint at ``path`` served as ``version`` from ``effective_at``
        on (a refit's cut-over; None: at once); ``announce``: the call also announces the target."""
        return encoded(LoadWeights(path=path, version=version, effective_at=effective_at, announce=announce))

    async def load(self, url: str, body: Encoded) -> CallResult:
        """The engine loads the checkpoint of ``body`` (:meth:`load_body`; its ``load_weights``)."""
        return await self.op(url, ControlOp.LOAD_WEIGHTS, body, timeout=self.load_s)

    async def load_checkpoint(
        self,
        url: str,
        path: str,
        version: str,
        effective_at: float | None = None,
        announce: LoadAnnounce | None = None,
    ) -> CallResult:
        """:meth:`load` of :meth:`load_body` on one engine."""
        return await self.load(url, self.load_body(path, version, effective_at, announce))

    async def op(
        self, url: str, op: ControlOp, body: BaseModel | Encoded | None = None, *, timeout: float | None = None
    ) -> CallResult:
        """``POST`` the route of ``op`` with ``body`` (the op's request model of
        :data:`drs_protocol.control.OPS`, or it :func:`encoded` once for a whole fan-out);
        ``timeout`` defaults to ``call_s`` (collective steps and loads pass ``load_s``)."""
        payload = _EMPTY if body is None else body if isinstance(body, Encoded) else encoded(body)
        return await self._call(
            "POST", url, CONTROL_ROUTES[op], payload, self.call_s if timeout is None else timeout, answer_model(op)
        )

    def _url(self, url: str) -> yarl.URL:
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= MAX_PARSED_URLS:  # engines come and go: never grow without bound
                self._urls.clear()
            parsed = self._urls[url] = yarl.URL(url)
        return parsed

    async def _exchange(self, method: str, url: str, body: Encoded | None, timeout: float) -> tuple[int, bytes]:
        async with self._client().request(
            method,
            self._url(url),
            data=None if body is None else body.data,
            timeout=self._timeout(timeout),
            headers=self._request_headers,
        ) as response:
            return response.status, await response.read()

    async def _exchange_resolved(
        self, method: str, url: str, body: Encoded | None, timeout: float
    ) -> tuple[int, bytes]:
        """:meth:`_exchange`, looking the engine's name up again while it does not resolve
        (within ``resolve_s``), the whole within ``timeout``: a try after failed lookups gets
        what is left of it."""
        started = time.perf_counter()
        deadline, give_up = started + timeout, started + min(self.resolve_s, timeout)
        delay, left = RESOLVE_FIRST_DELAY_S, timeout
        while True:
            try:
                return await self._exchange(method, url, body, left)
            except aiohttp.ClientConnectorDNSError:
                if time.perf_counter() + delay > give_up:
                    raise
            await asyncio.sleep(delay)  # back-off before the next lookup, not a wait on an event
            delay = min(delay * 2, RESOLVE_MAX_DELAY_S)
            left = max(deadline - time.perf_counter(), 0.01)  # the lookups spent part of the call's timeout

    async def _token_changed(self) -> bool:
        """After a 401: read the token again (``refresh``); True when it is another one."""
        if self._refresh is None:
            return False
        try:
            token = await self._refresh()
        except Exception:  # the Secret unreadable: the engine's 401 is the answer
            return False
        if not token or token == self.token:
            return False
        self.token, self._request_headers = token, {**_JSON, **fields.control_auth(token)}
        return True

    async def _call(
        self,
        method: str,
        url: str,
        route: str,
        body: Encoded | None,
        timeout: float,
        model: type[BaseModel],
    ) -> CallResult:
        started = time.perf_counter()
        try:
            status, content = await self._exchange_resolved(method, url + route, body, timeout)
            if status == 401 and await self._token_changed():  # once more, in what is left of the timeout
                left = max(timeout - (time.perf_counter() - started), 0.01)
                status, content = await self._exchange(method, url + route, body, left)
        except TimeoutError:  # aiohttp's ServerTimeoutError is one too
            elapsed = time.perf_counter() - started
            return CallResult(url, False, None, f"no answer within {timeout:g}s", elapsed, timed_out=True)
        except (aiohttp.ClientError, OSError) as exc:
            return CallResult(
                url, False, None, f"unreachable: {type(exc).__name__}: {exc}", time.perf_counter() - started
            )
        elapsed = time.perf_counter() - started
        if status == 200:
            try:
                answer = model.model_validate_json(content)
            except ValidationError as exc:
                return CallResult(url, False, 200, f"its answer breaks the control API's contract: {exc}", elapsed)
            version = getattr(answer, "weights_version", None)
            digest = getattr(answer, "weights_digest", None)
            return CallResult(url, True, 200, "", elapsed, version, digest, answer)
        try:
            data = json.loads(content)
        except ValueError:
            data = {}
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        kind = error.get("type") if isinstance(error, dict) else None
        detail = str(message or content[:500].decode("utf-8", "replace"))
        return CallResult(url, False, status, detail, elapsed, error_type=kind if isinstance(kind, str) else None)
